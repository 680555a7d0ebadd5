"""The report against the source document's recipe run through transformers on the same weights.

`mean` must be the document's figure (batch size 1, eager attention, svdvals per head, averaged)
to float32 precision; the other per-layer statistics and the rank-collapse residuals must equal
direct computations from transformers' outputs.
"""

from __future__ import annotations

import pytest
import torch

from model.analysis import analyze
from model.spectral import LAPACK_BELOW
from tests.analysis.conftest import TEXTS
from tests.analysis.document_recipe import (
    document_sigmas,
    load_document_model,
    load_document_tokenizer,
    residual_stream,
)
from weights.checkpoint import load_model

# Two float32 computations of the same attention probabilities (different matmul kernels),
# then LAPACK on each: they agree to a few float32 ulps; 1e-5 relative leaves room.
FLOAT32_RTOL = 1e-5
FAST_RTOL = 1e-4


def assert_close(actual, expected, rtol: float, what: str) -> None:
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, what
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=0.0, msg=what)


def check_against_recipe(model, document_model, token_ids: list[list[int]], method: str, rtol: float) -> None:
    report = analyze(model, token_ids, method).to_dict()
    sigmas = document_sigmas(document_model, token_ids).double()  # [S, L, H]
    assert [entry["layer"] for entry in report["layers"]] == list(range(sigmas.shape[1]))
    for layer, entry in enumerate(report["layers"]):
        expected = sigmas[:, layer]  # [S, H]
        measured = entry["spectral_norm"]
        assert_close(measured["mean"], expected.mean(), rtol, f"layer {layer} mean")
        assert_close(measured["min"], expected.min(), rtol, f"layer {layer} min")
        assert_close(measured["max"], expected.max(), rtol, f"layer {layer} max")
        assert_close(measured["per_head_mean"], expected.mean(dim=0), rtol, f"layer {layer} per head")
        # std is a difference of nearby numbers: compare it on the scale of the values.
        assert abs(measured["std"] - expected.std(correction=0).item()) < 10 * rtol * expected.max().item()
    for s, sequence in enumerate(report["sequences"]):
        assert sequence["n_tokens"] == len(token_ids[s])
        assert_close([l["spectral_norm"] for l in sequence["layers"]], sigmas[s], rtol, f"sequence {s}")


@pytest.mark.parametrize("method,rtol", [("exact", FLOAT32_RTOL), ("fast", FAST_RTOL)])
def test_tiny_model_matches_the_document_recipe(tiny_model, tiny_document_model, document_tokenizer, method, rtol) -> None:
    # The document tokenizes with transformers' AutoTokenizer; the texts have different lengths,
    # the last one long enough for method=fast to iterate rather than hand over to LAPACK.
    long_text = " ".join(TEXTS * 4)
    token_ids = [document_tokenizer(text)["input_ids"] for text in TEXTS]
    token_ids.append(document_tokenizer(long_text)["input_ids"][: tiny_model.config.n_positions])
    assert len({len(ids) for ids in token_ids}) == len(token_ids)
    assert len(token_ids[-1]) >= LAPACK_BELOW
    check_against_recipe(tiny_model, tiny_document_model, token_ids, method, rtol)


def test_residual_norms_equal_a_direct_computation(tiny_model, tiny_document_model, document_tokenizer) -> None:
    token_ids = [document_tokenizer(text)["input_ids"] for text in TEXTS]
    report = analyze(tiny_model, token_ids, "fast").to_dict()
    per_sequence = []
    for ids, sequence in zip(token_ids, report["sequences"]):
        stream = residual_stream(tiny_document_model, ids)  # L + 1 of [n, d]
        centred = [h - h.mean(dim=0, keepdim=True) for h in stream]
        norms = torch.stack([c.norm() for c in centred])
        relative = norms / torch.stack([h.norm() for h in stream])
        assert_close(sequence["residual_norm"], norms, FLOAT32_RTOL, "residual norms")
        assert_close(sequence["relative_residual"], relative, FLOAT32_RTOL, "relative residuals")
        per_sequence.append(norms)
    # The summary averages over sequences, index 0 the embeddings.
    assert_close([r["residual_norm"] for r in report["rank_collapse"]], torch.stack(per_sequence).mean(dim=0), FLOAT32_RTOL, "mean")
    assert [r["index"] for r in report["rank_collapse"]] == list(range(tiny_model.config.n_layer + 1))


def test_last_residual_is_taken_before_ln_f(tiny_model, tiny_document_model) -> None:
    # transformers' last hidden state is after ln_f: a report that used it would differ here.
    ids = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]
    hidden_after_ln_f = tiny_document_model(torch.tensor([ids], device=tiny_document_model.device), output_hidden_states=True).hidden_states[-1][0].cpu()
    after_ln_f = (hidden_after_ln_f - hidden_after_ln_f.mean(dim=0)).norm().item()
    reported = analyze(tiny_model, [ids], "fast").to_dict()["sequences"][0]["residual_norm"][-1]
    direct = residual_stream(tiny_document_model, ids)[-1]
    assert_close(reported, (direct - direct.mean(dim=0)).norm(), FLOAT32_RTOL, "before ln_f")
    assert abs(reported - after_ln_f) > 100 * FLOAT32_RTOL * reported


@pytest.fixture(scope="module")
def default_models(default_model_dir, device):
    document_model = load_document_model(default_model_dir).to(device)
    return load_model(default_model_dir, device=device), document_model, load_document_tokenizer(default_model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("method,rtol", [("exact", FLOAT32_RTOL), ("fast", FAST_RTOL)])
def test_default_124m_model_matches_the_document_recipe(default_models, method, rtol) -> None:
    model, document_model, tokenizer = default_models
    # Short, but long enough for method=fast to iterate rather than hand over to LAPACK.
    ids = tokenizer(" ".join(TEXTS * 3))["input_ids"][: LAPACK_BELOW + 8]
    check_against_recipe(model, document_model, [ids], method, rtol)


def test_a_bfloat16_served_model_is_measured_on_float32_probabilities(tiny_model_dir, tiny_model, document_tokenizer, device) -> None:
    token_ids = [document_tokenizer(text)["input_ids"] for text in TEXTS]
    served = load_model(tiny_model_dir, device=device, dtype=torch.bfloat16)
    report = analyze(served, token_ids, "fast")
    assert all(s.spectral_norm.dtype == torch.float32 for s in report.sequences)
    # bfloat16 weights give slightly different probabilities (8-bit mantissas), not other ones.
    full = analyze(tiny_model, token_ids, "fast").to_dict()
    for ours, reference in zip(report.to_dict()["layers"], full["layers"]):
        assert ours["spectral_norm"]["mean"] == pytest.approx(reference["spectral_norm"]["mean"], rel=2e-2)
