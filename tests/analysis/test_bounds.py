"""The bounds beside each measurement: their formulas against direct computations, and on many
random models and inputs every measured norm within [lower, colsum] and below prenorm."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from model.analysis import analyze
from model.attention_bounds import prenorm_bound, seed_prenorm, weight_spectra
from tests.conftest import TINY, perturbed_state
from weights.checkpoint import load_model
from weights.random_init import write_model_dir

# Bounds are exact mathematics; the measurements carry float32 rounding.
ROUNDING = 1e-5
WEIGHT_SCALES = (0.3, 1.0, 4.0, 12.0)  # from near-uniform attention to nearly one-hot


def scaled_model(directory: Path, scale: float, seed: int, device: torch.device | str = "cpu"):
    """The tiny model with its query/key weights scaled: larger logits, sharper attention."""
    state = perturbed_state(TINY, seed=seed)
    for name, tensor in state.items():
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            tensor[..., : 2 * TINY.n_embd] *= scale  # W_Q, W_K and their biases, not W_V
    write_model_dir(directory / f"scale-{scale}-seed-{seed}", TINY, state)
    return load_model(directory / f"scale-{scale}-seed-{seed}", device=device)


def random_sequences(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, TINY.n_positions + 1, (count,), generator=generator)
    return [torch.randint(0, TINY.vocab_size, (int(n),), generator=generator).tolist() for n in lengths]


def test_weight_spectra_equal_direct_float64_svds(tiny_model, tiny_document_model) -> None:
    spectra = weight_spectra(tiny_model)
    d, heads, d_h = TINY.n_embd, TINY.n_head, TINY.head_dim
    for layer, block in enumerate(tiny_document_model.h):  # transformers' copy of the same weights
        weight = block.attn.c_attn.weight.detach().double().cpu().numpy()  # [d, 3d]
        bias = block.attn.c_attn.bias.detach().double().cpu().numpy()
        gamma = block.ln_1.weight.detach().double().cpu().numpy()
        beta = block.ln_1.bias.detach().double().cpu().numpy()
        radius = np.abs(gamma).max() * math.sqrt(d) + np.linalg.norm(beta)
        for head in range(heads):
            cols = slice(head * d_h, (head + 1) * d_h)
            norms = [np.linalg.norm(weight[:, part * d:(part + 1) * d][:, cols], 2) for part in range(3)]
            q_bias, k_bias = (np.linalg.norm(bias[part * d:(part + 1) * d][cols]) for part in range(2))
            expected_m = (norms[0] * radius + q_bias) * (norms[1] * radius + k_bias) / math.sqrt(d_h)
            got = [spectra.query, spectra.key, spectra.value]
            for part in range(3):
                assert got[part][layer, head].item() == pytest.approx(norms[part], rel=1e-9)
            assert spectra.logit_bound[layer, head].item() == pytest.approx(expected_m, rel=1e-9)
            seed_m = np.abs(gamma).max() ** 2 * norms[0] * norms[1] * math.sqrt(d)
            assert spectra.seed_logit_bound[layer, head].item() == pytest.approx(seed_m, rel=1e-9)
        for ours, theirs in ((spectra.attn_proj, block.attn.c_proj), (spectra.mlp_fc, block.mlp.c_fc), (spectra.mlp_proj, block.mlp.c_proj)):
            assert ours[layer].item() == pytest.approx(np.linalg.norm(theirs.weight.detach().double().cpu().numpy(), 2), rel=1e-9)


def test_logits_stay_within_the_weight_bound(tiny_model, tiny_document_model) -> None:
    """M bounds every attention logit |q·k| / sqrt(d_h), measured inside transformers' forward."""
    spectra = weight_spectra(tiny_model)
    captured = {}
    hooks = [
        block.ln_1.register_forward_hook(lambda m, a, out, layer=layer: captured.__setitem__(layer, out[0]))
        for layer, block in enumerate(tiny_document_model.h)
    ]
    try:
        for ids in random_sequences(4, seed=3):
            with torch.no_grad():
                tiny_document_model(torch.tensor([ids], device=tiny_document_model.device))
            for layer, block in enumerate(tiny_document_model.h):
                q, k, _ = block.attn.c_attn(captured[layer]).split(TINY.n_embd, dim=-1)  # 3 × [n, d]
                q = q.view(-1, TINY.n_head, TINY.head_dim).transpose(0, 1)  # [H, n, d_h]
                k = k.view(-1, TINY.n_head, TINY.head_dim).transpose(0, 1)  # [H, n, d_h]
                logits = (q @ k.mT).abs().amax(dim=(1, 2)).cpu() / math.sqrt(TINY.head_dim)  # [H]
                assert (logits <= spectra.logit_bound[layer] * (1 + ROUNDING)).all()
    finally:
        for hook in hooks:
            hook.remove()


def test_prenorm_and_seed_formulas_equal_direct_sums() -> None:
    for n in (1, 2, 17, 1024):
        for m in (0.0, 0.3, 2.0, 40.0, 500.0):
            direct = math.sqrt(sum(1.0 / (1.0 + i * math.exp(-2 * m)) for i in range(n)))
            assert prenorm_bound(n, torch.tensor(m, dtype=torch.float64)).item() == pytest.approx(direct, rel=1e-12)
            seed = math.sqrt(n / (1.0 + (n - 1) * math.exp(-2 * m)))
            assert seed_prenorm(n, torch.tensor(m, dtype=torch.float64)).item() == pytest.approx(seed, rel=1e-12)


@pytest.mark.parametrize("scale", WEIGHT_SCALES)
def test_every_measured_norm_lies_within_its_bounds(tmp_path, scale: float, device) -> None:
    for seed in range(2):
        model = scaled_model(tmp_path, scale, seed, device)
        report = analyze(model, random_sequences(6, seed=10 * seed + 1), "exact")
        for sequence in report.sequences:
            bounds = report.bounds(sequence)
            norms = sequence.spectral_norm.double()  # [L, H]
            slack = ROUNDING * norms
            assert (norms >= 1.0 - slack).all(), "below the lower bound 1"
            assert (norms <= bounds["colsum"] + slack).all(), "above sqrt(max column sum)"
            assert (bounds["colsum"] <= bounds["trivial"] + slack).all()
            assert (norms <= bounds["prenorm"] + slack).all(), "above the weight-only bound"
            assert (bounds["prenorm"] <= bounds["trivial"] * (1 + 1e-12)).all()
        for entry in report.to_dict()["layers"]:
            for name in ("lower", "colsum", "trivial", "prenorm"):
                assert entry["bounds"][name]["valid"] and entry["bounds"][name]["violations"] == 0, name
            assert entry["bounds"]["seed_prenorm"]["valid"] is False


def test_seed_formula_is_reported_as_invalid_because_it_fails(tmp_path, device) -> None:
    """docs/analysis.md: on small random weights the document's formula falls below the measurement."""
    report = analyze(scaled_model(tmp_path, 0.3, seed=0, device=device), random_sequences(3, seed=5), "exact").to_dict()
    violations = sum(entry["bounds"]["seed_prenorm"]["violations"] for entry in report["layers"])
    assert violations > 0
    assert all(entry["bounds"]["prenorm"]["violations"] == 0 for entry in report["layers"])
