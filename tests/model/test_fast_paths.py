"""Every kernel choice of model/linear.py computes what PyTorch's defaults and transformers compute.

The fast paths change only how the matrix products run (oneDNN, inductor-compiled one-row
loops): float32 logits stay within LOGIT_TOLERANCE of transformers, greedy tokens stay the same,
and bfloat16 stays within bfloat16's rounding of the default bfloat16 path.
"""

from __future__ import annotations

import pytest
import torch

from model.config import GPT2Config
from model.generate import greedy_generate, greedy_generate_uncached
from model.kv_cache import KVCache
from model.linear import REFERENCE, Conv1D, Kernels
from tests.conftest import write_tiny_model
from tests.model.hf_reference import LOGIT_TOLERANCE, load_reference, random_ids
from weights.checkpoint import load_model

ONEDNN = Kernels.choose(torch.device("cpu"), torch.float32)
COMPILED = Kernels.choose(torch.device("cpu"), torch.float32, compile_rows=True)
CHOICES = {"reference": REFERENCE, "onednn": ONEDNN, "compiled-rows": COMPILED}

# Widths that are not multiples of the 16-float vectors, so the loops' tails run too.
ODD = GPT2Config(vocab_size=301, n_positions=40, n_embd=36, n_layer=2, n_head=4, n_inner=52)


def with_kernels(model, kernels: Kernels):
    """The model with `kernels` everywhere (prepare() picks them for the device; tests force them)."""
    model.prepare()
    model.kernels = kernels
    for module in model.modules():
        if isinstance(module, Conv1D):
            module.kernels = kernels
    return model


@pytest.fixture(scope="module", params=["tiny", "odd-widths"])
def model_dir(request, tiny_model_dir, tmp_path_factory):
    if request.param == "tiny":
        return tiny_model_dir
    return write_tiny_model(tmp_path_factory.mktemp("odd-gpt2"), ODD)


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir, load_model(model_dir).config)


def test_oneDNN_is_chosen_on_cpu_for_float32_and_bfloat16_only():
    cpu = torch.device("cpu")
    assert Kernels.choose(cpu, torch.float32).onednn == torch.backends.mkldnn.is_available()
    assert Kernels.choose(cpu, torch.bfloat16).onednn == torch.backends.mkldnn.is_available()
    assert not Kernels.choose(cpu, torch.float16).onednn
    assert Kernels.choose(torch.device("cuda"), torch.float32, compile_rows=True) == REFERENCE


@pytest.mark.parametrize("name", CHOICES)
@torch.no_grad()
def test_prefill_and_cached_decode_match_transformers(model_dir, reference, name):
    model = with_kernels(load_model(model_dir), CHOICES[name])
    ids = random_ids(model.config, batch=1, length=12, seed=5)  # [1, 12]
    expected = reference(ids).logits[0]  # [12, V]
    cache = KVCache(model.config, max_slots=2, max_len=12)
    rows = cache.batch(cache.allocate(1))
    prefill = model(ids[:, :6], cache=cache, rows=rows).logits[0]  # [6, V]
    assert (prefill - expected[:6]).abs().max().item() <= LOGIT_TOLERANCE
    with torch.inference_mode():  # the engine decodes in inference mode: both modes must work
        for t in range(6, 12):
            step = model(ids[:, t : t + 1], torch.tensor([[t]]), cache, rows, kv_length=t + 1)
            diff = (step.logits[0, -1] - expected[t]).abs().max().item()
            assert diff <= LOGIT_TOLERANCE, f"{name}, position {t}: max |logit diff| {diff:.3g}"


@pytest.mark.parametrize("name", ["onednn", "compiled-rows"])
@torch.no_grad()
def test_batched_decode_rows_match_the_reference_kernels(model_dir, name):
    """Several rows at different positions (the oneDNN path), then one row (the compiled path)."""
    fast = with_kernels(load_model(model_dir), CHOICES[name])
    slow = with_kernels(load_model(model_dir), REFERENCE)
    ids = random_ids(fast.config, batch=3, length=10, seed=6)  # [3, 10]
    positions = torch.tensor([[9], [4], [7]])  # [3, 1]
    outputs = []
    for model in (fast, slow):
        cache = KVCache(model.config, max_slots=3, max_len=10)
        rows = cache.batch(cache.allocate(3))
        model(ids, cache=cache, rows=rows)
        batch = model(ids.gather(1, positions), positions, cache, rows, kv_length=10).logits[:, -1]
        single = model(ids[:1, 9:], positions[:1], cache, cache.batch([0]), kv_length=10).logits[:, -1]
        outputs.append((batch, single))
    for got, want in zip(outputs[0], outputs[1]):
        assert (got - want).abs().max().item() <= LOGIT_TOLERANCE


@torch.no_grad()
def test_greedy_tokens_match_transformers_generate(model_dir, reference):
    prompt = random_ids(reference.config, batch=1, length=5, seed=7)  # [1, 5]
    reference.generation_config.eos_token_id = None  # plain greedy for all 12 tokens
    expected = reference.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
        pad_token_id=0,
    )[:, 5:]
    for name, kernels in CHOICES.items():
        model = with_kernels(load_model(model_dir), kernels)
        assert torch.equal(greedy_generate(model, prompt, 12), expected), name
    assert torch.equal(greedy_generate_uncached(model, prompt, 12), expected)


@pytest.mark.parametrize("name", ["onednn", "compiled-rows"])
@torch.no_grad()
def test_bfloat16_fast_paths_stay_within_bfloat16_rounding(tiny_model_dir, name):
    kernels = Kernels.choose(torch.device("cpu"), torch.bfloat16, compile_rows=name == "compiled-rows")
    fast = with_kernels(load_model(tiny_model_dir, dtype=torch.bfloat16), kernels)
    slow = with_kernels(load_model(tiny_model_dir, dtype=torch.bfloat16), REFERENCE)
    exact = load_model(tiny_model_dir)  # float32: what both approximate
    ids = random_ids(exact.config, batch=1, length=8, seed=8)
    want = exact(ids).logits.float()
    # One token at a time, so the compiled path sees one-row products.
    cache_fast, cache_slow = (KVCache(exact.config, 1, 8, dtype=torch.bfloat16) for _ in range(2))
    rows = cache_fast.batch(cache_fast.allocate(1))
    cache_slow.allocate(1)
    for t in range(8):
        args = (ids[:, t : t + 1], torch.tensor([[t]]))
        got = fast(*args, cache_fast, rows, kv_length=t + 1).logits[0, -1].float()
        ref = slow(*args, cache_slow, rows, kv_length=t + 1).logits[0, -1].float()
        # bfloat16 keeps 8 bits of mantissa: the default path's own error sets the scale.
        scale = (ref - want[0, t]).abs().max().item()
        assert (got - want[0, t]).abs().max().item() <= 2 * scale + 1e-3, f"position {t}"


def test_prepare_keeps_checkpoint_names_shapes_and_values(tiny_model_dir):
    model = load_model(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.prepare(compile_rows=False)  # a second prepare changes nothing either
    after = model.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert after[name].shape == tensor.shape and torch.equal(after[name], tensor), name
    c_fc = model.h[0].mlp.c_fc
    assert c_fc.weight.shape == (model.config.n_embd, model.config.inner_dim)  # [in, out]
    assert c_fc.weight.t().is_contiguous()  # stored [out, in], one copy


@pytest.mark.slow
@torch.no_grad()
def test_default_model_fast_decode_matches_transformers(default_model_dir):
    """GPT-2 124M's real widths (768, 3072, 50257) through every fast path."""
    model = with_kernels(load_model(default_model_dir), COMPILED)
    reference = load_reference(default_model_dir, model.config)
    ids = random_ids(model.config, batch=1, length=6, seed=9)
    expected = reference(ids).logits[0]  # [6, V]
    cache = KVCache(model.config, max_slots=1, max_len=6)
    rows = cache.batch(cache.allocate(1))
    model(ids[:, :4], cache=cache, rows=rows)  # prefill: oneDNN, several rows
    for t in (4, 5):  # decode: one row, compiled loops
        got = model(ids[:, t : t + 1], torch.tensor([[t]]), cache, rows, kv_length=t + 1).logits[0, -1]
        assert (got - expected[t]).abs().max().item() <= LOGIT_TOLERANCE
