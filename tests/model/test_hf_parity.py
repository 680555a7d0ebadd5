"""Our GPT-2 gives transformers' logits on the same safetensors file (issue 2).

Every file here is written with random biases and LayerNorm parameters (conftest.perturbed_state),
so a dropped or misplaced bias shows in the logits.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from model.config import GPT2Config
from tests.conftest import TINY, perturbed_state, write_tiny_model
from tests.model.hf_reference import LOGIT_TOLERANCE, load_reference, max_logit_diff, random_ids
from tests.weights.builders import shard
from weights.checkpoint import load_model

# Small vocabulary and width: these tests are about layouts and shapes, not the vocabulary.
SMALL = GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=2)

SHAPES = {
    "one-head": SMALL.with_(n_head=1, n_embd=24),
    "two-heads-odd-head-dim": SMALL.with_(n_head=2, n_embd=42),  # head_dim 21
    "four-heads-odd-head-dim": SMALL.with_(n_head=4, n_embd=36, n_layer=3),  # head_dim 9
    "n-inner-set": SMALL.with_(n_inner=50),
    "few-positions": SMALL.with_(n_positions=8),
    "layer-norm-epsilon": SMALL.with_(layer_norm_epsilon=1e-2),
    "real-vocab": TINY,
}


def assert_matches_reference(model_dir, config: GPT2Config, length: int = 16) -> None:
    ours = load_model(model_dir)
    reference = load_reference(model_dir, config)
    ids = random_ids(config, batch=2, length=min(length, config.n_positions))
    diff = max_logit_diff(ours, reference, ids)
    assert diff <= LOGIT_TOLERANCE, f"max |logit diff| {diff:.3g}"


@pytest.mark.parametrize("config", SHAPES.values(), ids=SHAPES.keys())
def test_shapes_match_transformers(tmp_path, config):
    write_tiny_model(tmp_path, config)
    # The full context too: position embeddings up to the last one.
    assert_matches_reference(tmp_path, config, length=config.n_positions)


def layout_extras(config: GPT2Config, prefixed: bool, buffers: bool, lm_head: bool, dtype) -> dict:
    """The tensors some GPT-2 files carry besides the parameters."""
    prefix = "transformer." if prefixed else ""
    extra = {}
    if buffers:  # as older transformers versions saved them
        causal = torch.tril(torch.ones(config.n_positions, config.n_positions))
        for i in range(config.n_layer):
            extra[f"{prefix}h.{i}.attn.bias"] = causal.view(1, 1, *causal.shape).clone()  # [1,1,P,P]
            extra[f"{prefix}h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    if lm_head:  # a copy of the tied head, stored as the embedding is
        extra["lm_head.weight"] = perturbed_state(config)["wte.weight"].to(dtype)
    return extra


@pytest.mark.parametrize(
    "prefixed,buffers,lm_head", list(itertools.product([True, False], repeat=3))
)
def test_name_layouts_match_transformers(tmp_path, prefixed, buffers, lm_head):
    extra = layout_extras(SMALL, prefixed, buffers, lm_head, torch.float32)
    write_tiny_model(tmp_path, SMALL, prefixed=prefixed, extra_tensors=extra)
    assert_matches_reference(tmp_path, SMALL)


@pytest.mark.parametrize("prefixed", [True, False], ids=["prefixed", "bare"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_stored_dtypes_match_transformers_in_fp32(tmp_path, dtype, prefixed):
    extra = layout_extras(SMALL, prefixed, buffers=not prefixed, lm_head=prefixed, dtype=dtype)
    write_tiny_model(tmp_path, SMALL, prefixed=prefixed, dtype=dtype, extra_tensors=extra)
    assert load_model(tmp_path).dtype == torch.float32
    assert_matches_reference(tmp_path, SMALL)


def test_sharded_checkpoint_matches_transformers(tmp_path):
    write_tiny_model(tmp_path, SMALL)
    shards = shard(tmp_path, n_shards=2)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == shards
    assert_matches_reference(tmp_path, SMALL)


@torch.no_grad()
def test_attentions_and_hidden_states_match_transformers(tiny_model_dir):
    ours = load_model(tiny_model_dir)
    reference = load_reference(tiny_model_dir, TINY)
    ids = random_ids(TINY, batch=2, length=12)
    expected = reference(ids, output_attentions=True, output_hidden_states=True)
    actual = ours(ids, output_attentions=True, output_hidden_states=True)
    assert len(actual.attentions) == len(expected.attentions) == TINY.n_layer
    for layer, (a, e) in enumerate(zip(actual.attentions, expected.attentions)):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=0, msg=f"attention probs, layer {layer}")
    # transformers' last hidden state has ln_f applied; ours is the last block's output.
    assert len(actual.hidden_states) == len(expected.hidden_states) == TINY.n_layer + 1
    actual_hidden = [*actual.hidden_states[:-1], ours.ln_f(actual.hidden_states[-1])]
    for i, (a, e) in enumerate(zip(actual_hidden, expected.hidden_states)):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=0, msg=f"hidden state {i}")
    torch.testing.assert_close(actual.logits, expected.logits, atol=LOGIT_TOLERANCE, rtol=0)


@pytest.mark.slow
def test_default_124m_weights_match_transformers(default_model_dir):
    config = GPT2Config.from_json(default_model_dir / "config.json")
    assert config == GPT2Config.preset("gpt2")
    assert_matches_reference(default_model_dir, config, length=32)
