"""The packed oneDNN path of model/linear.py computes what PyTorch's defaults and transformers do.

Packing changes only how the matrix products run: float32 logits stay within LOGIT_TOLERANCE of
transformers, greedy tokens stay the same, and bfloat16 stays within bfloat16's rounding of
PyTorch's default bfloat16 path.
"""

from __future__ import annotations

import pytest
import torch

from model.config import GPT2Config
from model.generate import greedy_generate, greedy_generate_uncached
from model.kv_cache import KVCache
from model.linear import onednn_serves, pack
from tests.conftest import write_tiny_model
from tests.model.hf_reference import LOGIT_TOLERANCE, load_reference, random_ids
from weights.checkpoint import load_model

pytestmark = pytest.mark.skipif(
    not onednn_serves(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN"
)
PATHS = {"packed": True, "pytorch-default": False}

# Widths that are not multiples of the 16-float vectors, so the kernels' tails run too.
ODD = GPT2Config(vocab_size=301, n_positions=40, n_embd=36, n_layer=2, n_head=4, n_inner=52)


def loaded(model_dir, packed: bool, dtype: torch.dtype = torch.float32):
    model = load_model(model_dir, dtype=dtype)
    model.prepare(use_packed=packed)
    assert (model.h[0].mlp.c_fc.packed is not None) == packed  # the path under test is taken
    return model


@pytest.fixture(scope="module", params=["tiny", "odd-widths"])
def model_dir(request, tiny_model_dir, tmp_path_factory):
    if request.param == "tiny":
        return tiny_model_dir
    return write_tiny_model(tmp_path_factory.mktemp("odd-gpt2"), ODD)


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir, load_model(model_dir).config)


def test_packing_is_chosen_on_cpu_for_float32_and_bfloat16_only():
    cpu = torch.device("cpu")
    assert onednn_serves(cpu, torch.float32) and onednn_serves(cpu, torch.bfloat16)
    assert not onednn_serves(cpu, torch.float16)
    assert not onednn_serves(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("path", PATHS)
@torch.no_grad()
def test_prefill_and_cached_decode_match_transformers(model_dir, reference, path):
    model = loaded(model_dir, PATHS[path])
    ids = random_ids(model.config, batch=1, length=12, seed=5)  # [1, 12]
    expected = reference(ids).logits[0]  # [12, V]
    cache = KVCache(model.config, max_slots=2, max_len=12)
    rows = cache.batch(cache.allocate(1))
    prefill = model(ids[:, :6], cache=cache, rows=rows).logits[0]  # [6, V]
    assert (prefill - expected[:6]).abs().max().item() <= LOGIT_TOLERANCE
    with torch.inference_mode():  # the engine decodes in inference mode
        for t in range(6, 12):
            step = model(ids[:, t : t + 1], torch.tensor([[t]]), cache, rows, kv_length=t + 1)
            diff = (step.logits[0, -1] - expected[t]).abs().max().item()
            assert diff <= LOGIT_TOLERANCE, f"{path}, position {t}: max |logit diff| {diff:.3g}"


@torch.no_grad()
def test_batched_and_single_row_decode_match_the_default_kernels(model_dir):
    """Several rows at different positions (beam search, batched decode), then one row."""
    outputs = []
    for packed in (True, False):
        model = loaded(model_dir, packed)
        ids = random_ids(model.config, batch=3, length=10, seed=6)  # [3, 10]
        positions = torch.tensor([[9], [4], [7]])  # [3, 1]
        cache = KVCache(model.config, max_slots=3, max_len=10)
        rows = cache.batch(cache.allocate(3))
        model(ids, cache=cache, rows=rows)
        batch = model(ids.gather(1, positions), positions, cache, rows, kv_length=10).logits[:, -1]
        single = model(ids[:1, 9:], positions[:1], cache, cache.batch([0]), kv_length=10).logits[:, -1]
        outputs.append((batch, single))
    for got, want in zip(*outputs):
        assert (got - want).abs().max().item() <= LOGIT_TOLERANCE


@torch.no_grad()
def test_greedy_tokens_match_transformers_generate(model_dir, reference):
    prompt = random_ids(reference.config, batch=1, length=5, seed=7)  # [1, 5]
    reference.generation_config.eos_token_id = None  # plain greedy for all 12 tokens
    expected = reference.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False, pad_token_id=0
    )[:, 5:]
    model = loaded(model_dir, packed=True)
    assert torch.equal(greedy_generate(model, prompt, 12), expected)
    assert torch.equal(greedy_generate_uncached(model, prompt, 12), expected)


@torch.no_grad()
def test_bfloat16_packed_stays_within_bfloat16_rounding(tiny_model_dir):
    if pack(torch.zeros(16, 16, dtype=torch.bfloat16)) is None:
        pytest.skip("this CPU has no oneDNN bfloat16 path (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    fast = loaded(tiny_model_dir, packed=True, dtype=torch.bfloat16)
    slow = loaded(tiny_model_dir, packed=False, dtype=torch.bfloat16)
    ids = random_ids(fast.config, batch=1, length=8, seed=8)
    want = loaded(tiny_model_dir, packed=False)(ids).logits[0]  # float32: what both approximate
    caches = [KVCache(fast.config, 1, 8, dtype=torch.bfloat16) for _ in range(2)]
    rows = [cache.batch(cache.allocate(1)) for cache in caches]
    for t in range(8):  # one token at a time: the one-row products decode runs
        args = (ids[:, t : t + 1], torch.tensor([[t]]))
        got = fast(*args, caches[0], rows[0], kv_length=t + 1).logits[0, -1].float()
        ref = slow(*args, caches[1], rows[1], kv_length=t + 1).logits[0, -1].float()
        # bfloat16 keeps 8 bits of mantissa: PyTorch's own bfloat16 error sets the scale.
        scale = (ref - want[t]).abs().max().item()
        assert 0 < scale < 0.1
        assert (got - want[t]).abs().max().item() <= 2 * scale, f"position {t}"


@torch.no_grad()
def test_a_model_converted_after_prepare_falls_back_to_the_default_kernels(tiny_model_dir):
    converted = loaded(tiny_model_dir, packed=True).to(torch.bfloat16)  # packed copies now stale
    expected = loaded(tiny_model_dir, packed=False, dtype=torch.bfloat16)
    ids = random_ids(converted.config, batch=1, length=6, seed=10)
    assert torch.equal(converted(ids).logits, expected(ids).logits)


def test_prepare_keeps_checkpoint_names_shapes_and_values(tiny_model_dir):
    model = load_model(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.prepare()  # a second prepare changes nothing either
    after = model.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert after[name].shape == tensor.shape and torch.equal(after[name], tensor), name
    c_fc = model.h[0].mlp.c_fc
    assert c_fc.weight.shape == (model.config.n_embd, model.config.inner_dim)  # [in, out]
    assert c_fc.weight.t().is_contiguous()  # stored [out, in]
    assert c_fc.packed.is_mkldnn and c_fc.packed.shape == c_fc.weight.t().shape


@pytest.mark.slow
@torch.no_grad()
def test_default_model_packed_decode_matches_transformers(default_model_dir):
    """GPT-2 124M's real widths (768, 2304, 3072, 50257): prefill, then one-row decode."""
    model = loaded(default_model_dir, packed=True)
    reference = load_reference(default_model_dir, model.config)
    ids = random_ids(model.config, batch=1, length=6, seed=9)
    expected = reference(ids).logits[0]  # [6, V]
    cache = KVCache(model.config, max_slots=1, max_len=6)
    rows = cache.batch(cache.allocate(1))
    prefill = model(ids[:, :4], cache=cache, rows=rows).logits[0]  # [4, V]
    assert (prefill - expected[:4]).abs().max().item() <= LOGIT_TOLERANCE
    for t in (4, 5):
        got = model(ids[:, t : t + 1], torch.tensor([[t]]), cache, rows, kv_length=t + 1).logits[0, -1]
        assert (got - expected[t]).abs().max().item() <= LOGIT_TOLERANCE
