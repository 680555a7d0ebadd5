"""Post-LN GPT-1 against transformers' OpenAIGPTModel on random weights made here: the forward
(attention probabilities, residual stream), the analysis (the document's recipe on GPT-1), the
bounds, the checkpoint layouts, and the GPT-2-sized random preset."""

from __future__ import annotations

import json

import pytest
import torch

from model.analysis import analyze
from model.attention_bounds import weight_spectra
from model.gpt2 import GPT2
from model.post_ln import PRESETS, PostLNConfig, PostLNGPT
from model.spectral import LAPACK_BELOW
from tests.analysis.document_recipe import document_sigmas
from tests.analysis.post_ln_reference import TINY_POST_LN, load_post_ln_reference, reference_config, write_post_ln_checkpoint
from tests.analysis.test_bounds import ROUNDING, random_sequences
from weights.checkpoint import CheckpointError
from weights.post_ln import load_analysis_model, load_post_ln_model, write_random_post_ln

# The tolerance for parity with transformers, in float32 (observed: ~1e-6).
PARITY_TOL = 1e-4
FAST_RTOL = 1e-4


@torch.no_grad()
def test_forward_matches_transformers_openai_gpt(tiny_post_ln_model, tiny_post_ln_reference, device) -> None:
    for ids in random_sequences(4, seed=11):
        tokens = torch.tensor([ids], device=device)
        theirs = tiny_post_ln_reference(tokens, output_attentions=True, output_hidden_states=True)
        ours = tiny_post_ln_model(tokens, output_attentions=True, output_hidden_states=True)
        assert len(ours.attentions) == len(theirs.attentions) == TINY_POST_LN.n_layer
        for layer, (a, b) in enumerate(zip(ours.attentions, theirs.attentions)):
            torch.testing.assert_close(a, b, rtol=PARITY_TOL, atol=PARITY_TOL, msg=f"attention, layer {layer}")
        # transformers: the embeddings, then after every block (Post-LN: no final LayerNorm).
        assert len(ours.hidden_states) == len(theirs.hidden_states) == TINY_POST_LN.n_layer + 1
        for index, (a, b) in enumerate(zip(ours.hidden_states, theirs.hidden_states)):
            torch.testing.assert_close(a, b, rtol=PARITY_TOL, atol=PARITY_TOL, msg=f"hidden state {index}")


@torch.no_grad()
def test_tied_head_logits_match_openai_gpt_lm_head_model(tiny_post_ln_dir, tiny_post_ln_model, device) -> None:
    from transformers import OpenAIGPTLMHeadModel

    reference = OpenAIGPTLMHeadModel.from_pretrained(tiny_post_ln_dir, dtype=torch.float32).eval().to(device)
    ids = torch.tensor([random_sequences(1, seed=2)[0]], device=device)
    last = torch.tensor([ids.shape[1] - 1], device=device)
    torch.testing.assert_close(
        tiny_post_ln_model(ids, logits_index=last).logits, reference(ids).logits[:, -1], rtol=PARITY_TOL, atol=PARITY_TOL
    )


@pytest.mark.parametrize("method,rtol", [("exact", 1e-5), ("fast", FAST_RTOL)])
def test_analysis_matches_the_document_recipe_on_gpt1(tiny_post_ln_model, tiny_post_ln_reference, method, rtol) -> None:
    token_ids = random_sequences(3, seed=4)
    # One long enough for method=fast to iterate rather than hand over to LAPACK.
    token_ids.append(torch.randint(0, TINY_POST_LN.vocab_size, (LAPACK_BELOW + 20,), generator=torch.Generator().manual_seed(9)).tolist())
    report = analyze(tiny_post_ln_model, token_ids, method).to_dict()
    sigmas = document_sigmas(tiny_post_ln_reference, token_ids).double()  # [S, L, H]
    measured = torch.tensor([entry["spectral_norm"]["mean"] for entry in report["layers"]], dtype=torch.float64)
    torch.testing.assert_close(measured, sigmas.mean(dim=(0, 2)), rtol=rtol, atol=0.0)
    for s, sequence in enumerate(report["sequences"]):
        per_head = torch.tensor([layer["spectral_norm"] for layer in sequence["layers"]], dtype=torch.float64)
        torch.testing.assert_close(per_head, sigmas[s], rtol=rtol, atol=0.0)


@pytest.mark.parametrize("qk_scale", (0.3, 1.0, 6.0))
def test_bounds_hold_on_post_ln_models(tmp_path, default_model_dir, qk_scale, device) -> None:
    """The weight-only bound uses the previous block's ln_2, and the embeddings for layer 0."""
    model = load_post_ln_model(write_post_ln_checkpoint(tmp_path, default_model_dir, seed=3, qk_scale=qk_scale), device)
    report = analyze(model, random_sequences(5, seed=6), "exact")
    for sequence in report.sequences:
        bounds = report.bounds(sequence)
        norms = sequence.spectral_norm.double()  # [L, H]
        assert (norms >= 1.0 - ROUNDING * norms).all()
        assert (norms <= bounds["colsum"] * (1 + ROUNDING)).all()
        assert (norms <= bounds["prenorm"] * (1 + ROUNDING)).all()
    for entry in report.to_dict()["layers"]:
        for name in ("lower", "colsum", "trivial", "prenorm"):
            assert entry["bounds"][name]["violations"] == 0, (entry["layer"], name)


@torch.no_grad()
def test_attention_inputs_stay_within_the_radius_the_bound_uses(tiny_post_ln_model, tiny_post_ln_reference, device) -> None:
    radius = weight_spectra(tiny_post_ln_model).input_radius  # [L]
    captured = {}
    hooks = [
        block.attn.register_forward_pre_hook(lambda m, args, layer=layer: captured.__setitem__(layer, args[0]))
        for layer, block in enumerate(tiny_post_ln_reference.h)
    ]
    try:
        for ids in random_sequences(3, seed=8):
            tiny_post_ln_reference(torch.tensor([ids], device=device))
            for layer in range(TINY_POST_LN.n_layer):
                largest = captured[layer][0].double().norm(dim=-1).max().cpu()
                assert largest <= radius[layer] * (1 + ROUNDING), layer
    finally:
        for hook in hooks:
            hook.remove()


def test_both_checkpoint_layouts_load_and_bad_ones_are_refused(tmp_path, default_model_dir) -> None:
    bare = write_post_ln_checkpoint(tmp_path / "bare", default_model_dir, with_head=False)
    prefixed = write_post_ln_checkpoint(tmp_path / "prefixed", default_model_dir, with_head=True)
    for folder in (bare, prefixed):
        ours, theirs = load_analysis_model(folder), load_post_ln_reference(folder)
        assert isinstance(ours, PostLNGPT)
        assert torch.equal(ours.h[1].ln_2.weight, theirs.h[1].ln_2.weight)
        assert torch.equal(ours.positions_embed.weight, theirs.positions_embed.weight)
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps(config | {"n_layer": TINY_POST_LN.n_layer + 1}))
    with pytest.raises(CheckpointError, match="'h.3.attn.c_attn.weight'"):
        load_post_ln_model(bare)
    (bare / "config.json").write_text(json.dumps(config | {"afn": "relu"}))
    with pytest.raises(CheckpointError, match="afn"):
        load_post_ln_model(bare)


def test_gpt2_folders_still_load_as_gpt2(tiny_model_dir) -> None:
    assert isinstance(load_analysis_model(tiny_model_dir), GPT2)


def test_random_preset_has_gpt2s_size_and_loads_in_transformers(tmp_path, default_model_dir) -> None:
    from model.config import GPT2Config

    preset, gpt2 = PRESETS["post-ln-gpt2"], GPT2Config.preset("gpt2")
    shape = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
    assert [getattr(preset, k) for k in shape] == [getattr(gpt2, k) for k in shape]
    # The same writer on a small config: transformers loads the folder and computes what we do.
    small = PostLNConfig(vocab_size=preset.vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    folder = write_random_post_ln(tmp_path / "small", small, seed=1, tokenizer_dir=default_model_dir)
    ours, theirs = load_post_ln_model(folder), load_post_ln_reference(folder)
    assert theirs.config.to_dict()["n_embd"] == reference_config(small).n_embd
    ids = torch.tensor([random_sequences(1, seed=1)[0][:64]])
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids, output_attentions=True).attentions[-1], theirs(ids, output_attentions=True).attentions[-1],
            rtol=PARITY_TOL, atol=PARITY_TOL,
        )
    # GPT-1's init: every weight matrix N(0, 0.02), no residual scaling.
    assert ours.h[0].attn.c_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_a_tokenizer_without_gpt2s_end_of_text_still_encodes(tmp_path, default_model_dir) -> None:
    """GPT-1's tokenizer.json has no <|endoftext|>: the analysis only needs it to encode."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from service.analysis.report import load_subject

    folder = write_post_ln_checkpoint(tmp_path / "gpt1", default_model_dir)
    vocabulary = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    vocabulary.pre_tokenizer = pre_tokenizers.Whitespace()
    vocabulary.save(str(folder / "tokenizer.json"))
    subject = load_subject(folder, name="gpt1")
    assert subject.tokenizer.encode_batch(["hello world", "bye"]) == [[0, 1], [2]]
    assert subject.describe()["architecture"] == "post-ln"
