"""GPT-2-architecture checkpoints with transformers' other GPT2Config options give transformers'
logits (issue 46, item 6): Cerebras-GPT's exact `gelu` and 2,048 positions, Stanford CRFM's
`scale_attn_by_inverse_layer_idx` and `reorder_and_upcast_attn`, `scale_attn_weights: false`,
every activation transformers' ACT2FN names, with `n_inner` and `layer_norm_epsilon` beside them.

Each case is a small random copy written to a folder and read by both implementations, on the
test device (GPT2_TEST_DEVICE=cuda runs them on the GPU against transformers there). Every case
is checked to be sensitive: served without its option, the logits miss by far more than the
tolerance, so a dropped option cannot pass.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config as HFGPT2Config
from transformers.activations import ACT2FN
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

import model.attention as attention
from model.activations import ACTIVATIONS, TANH_GELU
from model.config import GPT2Config
from model.gpt2 import Packing
from model.kv_cache import KVCache
from tests.model.checkpoint_options import BASE, CASES, SENSITIVE, load_both, without_options, write_options_model
from tests.model.hf_reference import LOGIT_TOLERANCE, random_ids
from weights.checkpoint import load_model

# What serving a case without its option costs at least: far above the tolerance.
MISSED_BY = 10 * LOGIT_TOLERANCE


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, device):
    config = CASES[request.param]
    folder = write_options_model(tmp_path_factory.mktemp(request.param), config)
    ours, reference = load_both(folder, config, device)
    return request.param, config, folder, ours, reference


@torch.no_grad()
def test_full_forward_matches_transformers(case, device):
    name, config, folder, ours, reference = case
    ids = random_ids(config, batch=2, length=24, seed=1).to(device)
    expected = reference(ids).logits
    assert max_diff(ours(ids).logits, expected) <= LOGIT_TOLERANCE
    if name in SENSITIVE:
        plain = without_options(folder, config, device)
        assert max_diff(plain(ids).logits, expected) > MISSED_BY, "the case does not exercise its option"


# How the engine runs a step: plain; decode at the fixed key length CUDA graphs read (every row
# masked); prefill a query per call, as speculative verification does on the CPU.
ENGINE_MODES = ["exact", "fixed-key-length", "one-query-per-call"]


@pytest.mark.parametrize("mode", ENGINE_MODES)
@torch.no_grad()
def test_packed_prefill_and_cached_decode_match_transformers(case, device, mode):
    """The engine's way: rows of different lengths prefilled packed into their slots, then decoded a
    token at a time together, each at its own position."""
    _, config, _, ours, reference = case
    lengths, total = [5, 11, 2], 16
    sequences = random_ids(config, batch=len(lengths), length=total, seed=2).to(device)  # [B, 16]
    expected = reference(sequences).logits  # [B, 16, V]
    cache = KVCache(config, max_slots=4, max_len=total + 2, device=device)
    cache.allocate(cache.max_slots)  # every row with its blocks, as the engine's running rows
    slots = [3, 0, 2]
    flat = [(b * max(lengths) + j, slots[b], j) for b, n in enumerate(lengths) for j in range(n)]
    index, token_slots, positions = torch.tensor(flat, device=device).t()
    packing = Packing(index, len(lengths), max(lengths), token_slots, positions)
    prompt_ids = torch.cat([sequences[b, :n] for b, n in enumerate(lengths)])  # [N]
    out = ours.forward_packed(prompt_ids, packing, cache, cache.batch(slots), max(lengths),
                              one_query_per_call=mode == "one-query-per-call")
    prefill = ours.lm_head(out.head_input).split(lengths)  # B × [n_b, V]
    for b, n in enumerate(lengths):
        assert max_diff(prefill[b], expected[b, :n]) <= LOGIT_TOLERANCE, f"row {b} prefill"
    exact = mode != "fixed-key-length"
    at = list(lengths)
    while min(at) < total:
        step = [min(p, total - 1) for p in at]  # finished rows re-decode their last position
        ids = torch.stack([sequences[b, p] for b, p in enumerate(step)])[:, None]  # [B, 1]
        kv_length = max(step) + 1 if exact else total
        logits = ours(ids, torch.tensor(step, device=device)[:, None], cache, cache.batch(slots),
                      kv_length=kv_length, exact_kv_length=exact).logits[:, -1]  # [B, V]
        for b, p in enumerate(step):
            assert max_diff(logits[b], expected[b, p]) <= LOGIT_TOLERANCE, f"row {b} decode at {p}"
        at = [p + 1 for p in at]


@torch.no_grad()
def test_cached_prefill_and_lone_decode_match_transformers(case, device):
    """One row prefilled through the cache without packing, then decoded alone (the no-mask path)."""
    _, config, _, ours, reference = case
    sequence = random_ids(config, batch=1, length=14, seed=3).to(device)  # [1, 14]
    expected = reference(sequence).logits[0]  # [14, V]
    cache = KVCache(config, max_slots=2, max_len=14, device=device)
    rows = cache.batch(cache.allocate(1))
    assert max_diff(ours(sequence[:, :6], cache=cache, rows=rows).logits[0], expected[:6]) <= LOGIT_TOLERANCE
    for t in range(6, 14):
        logits = ours(sequence[:, t : t + 1], torch.tensor([[t]], device=device), cache, rows, kv_length=t + 1).logits
        assert max_diff(logits[0, -1], expected[t]) <= LOGIT_TOLERANCE, f"decode at {t}"


@torch.no_grad()
def test_attention_probabilities_match_transformers(case, device):
    """The analysis path computes its own float32 scores: the layer's scale holds there too."""
    _, config, _, ours, reference = case
    ids = random_ids(config, batch=1, length=10, seed=4).to(device)
    expected = reference(ids, output_attentions=True).attentions
    actual = ours(ids, output_attentions=True).attentions
    for layer, (a, e) in enumerate(zip(actual, expected)):
        assert max_diff(a, e) <= 1e-5, f"layer {layer}"


@torch.no_grad()
def test_the_last_of_2048_positions_decodes_as_transformers(tmp_path, device):
    """Cerebras-GPT's context: a 2,040-token prompt, then decode through the cache to position 2047."""
    config = CASES["cerebras-gelu-2048"]
    assert config.n_positions == 2048
    ours, reference = load_both(write_options_model(tmp_path, config), config, device)
    sequence = random_ids(config, batch=1, length=2048, seed=5).to(device)  # [1, 2048]
    expected = reference(sequence).logits[0]  # [2048, V]
    cache = KVCache(config, max_slots=1, max_len=2048, device=device)
    rows = cache.batch(cache.allocate(1))
    prefill = ours(sequence[:, :2040], cache=cache, rows=rows).logits[0]
    assert max_diff(prefill, expected[:2040]) <= LOGIT_TOLERANCE
    for t in range(2040, 2048):
        logits = ours(sequence[:, t : t + 1], torch.tensor([[t]], device=device), cache, rows, kv_length=t + 1).logits
        assert max_diff(logits[0, -1], expected[t]) <= LOGIT_TOLERANCE, f"decode at {t}"


# --- every activation transformers names -------------------------------------------------------
@pytest.mark.parametrize("name", sorted(ACT2FN.keys()))
def test_every_activation_transformers_names_is_computed_as_it_is_or_refused(name):
    if name not in ACTIVATIONS:
        with pytest.raises(ValueError, match=f"activation_function {name!r}"):
            BASE.with_(activation_function=name)
        return
    x = torch.linspace(-12, 12, 4001, dtype=torch.float64).float()
    expected = ACT2FN[name](x)
    assert max_diff(ACTIVATIONS[name](x), expected) <= 1e-6


@pytest.mark.parametrize("name", sorted(set(ACTIVATIONS) - set(TANH_GELU) | {"gelu_new"}))
@torch.no_grad()
def test_each_activation_serves_transformers_logits(tmp_path, device, name):
    config = BASE.with_(activation_function=name)
    folder = write_options_model(tmp_path, config)
    ours, reference = load_both(folder, config, device)
    ids = random_ids(config, batch=2, length=12, seed=6).to(device)
    expected = reference(ids).logits
    assert max_diff(ours(ids).logits, expected) <= LOGIT_TOLERANCE
    # gelu_new is GPT-2's own; gelu_fast is the same tanh approximation with its constant rounded
    # to 10 digits: nothing to tell apart.
    if name not in ("gelu_new", "gelu_fast"):
        plain = without_options(folder, config, device)
        assert max_diff(plain(ids).logits, expected) > MISSED_BY, f"{name} is too close to gelu_new to tell apart"


# --- reorder_and_upcast_attn in half precision -------------------------------------------------
HALF = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_upcast_attention_is_transformers_own(dtype):
    """Scores and softmax in float32, probabilities back in v's dtype: the same function as
    transformers' `_upcast_and_reordered_attn`, on the same inputs, to v's rounding."""
    options = {"n_embd": 64, "n_head": 4, "n_layer": 3, "reorder_and_upcast_attn": True, "scale_attn_by_inverse_layer_idx": True}
    layer = GPT2Attention(HFGPT2Config(**options), layer_idx=2).eval()
    ours = attention.AttentionMath.for_layer(GPT2Config(**options), 2)
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=generator).mul(30).to(dtype) for _ in range(3))
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]  # [1, 1, 9, 9]
    additive = torch.zeros(causal.shape).masked_fill(~causal, torch.finfo(torch.float32).min)
    expected = layer._upcast_and_reordered_attn(q, k, v, additive)[0].transpose(1, 2)  # [B, H, T, d_h]
    actual = ours(q, k, v, causal)
    assert actual.dtype == dtype
    assert max_diff(actual, expected) <= 2 * torch.finfo(dtype).eps * v.abs().max().item()


@pytest.mark.parametrize("dtype", HALF, ids=str)
@torch.no_grad()
def test_reorder_and_upcast_runs_float32_scores_on_every_path(tmp_path, monkeypatch, dtype):
    """A half-precision model with reorder_and_upcast_attn never hands its scores to SDPA in half
    precision: no cache, cached prefill, packed prefill, batched and lone decode, fixed key length."""
    config = CASES["crfm-both"]
    model = load_model(write_options_model(tmp_path, config), dtype=dtype)
    half_calls, upcast_calls = [], []
    real_sdpa, real_upcast = attention.F.scaled_dot_product_attention, attention.upcast_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda q, *a, **kw: half_calls.append(q.dtype) or real_sdpa(q, *a, **kw))
    monkeypatch.setattr(attention, "upcast_attention", lambda *a: upcast_calls.append(1) or real_upcast(*a))
    ids = random_ids(config, batch=2, length=8, seed=8)
    cache = KVCache(config, max_slots=2, max_len=10, dtype=dtype)
    rows = cache.batch(cache.allocate(2))
    model(ids)
    model(ids[:, :4], cache=cache, rows=rows)
    index = torch.tensor([0, 1, 2, 3, 8, 9])  # rows of 4 and 2 tokens at positions 4..
    packing = Packing(index, 2, 8, torch.tensor([0, 0, 0, 0, 1, 1]), torch.tensor([4, 5, 6, 7, 4, 5]))
    model.forward_packed(ids[0, :6], packing, cache, rows, kv_length=8)
    model(ids[:, :1], torch.tensor([[8], [6]]), cache, rows, kv_length=9)
    model(ids[:1, :1], torch.tensor([[8]]), cache, cache.batch([0]), kv_length=9)
    model(ids[:, :1], torch.tensor([[8], [6]]), cache, rows, kv_length=10, exact_kv_length=False)
    assert half_calls == [] and upcast_calls


@pytest.mark.parametrize("dtype", HALF, ids=str)
@torch.no_grad()
def test_half_precision_with_reorder_and_upcast_tracks_transformers(tmp_path, device, dtype):
    """A float16/bfloat16 model with both CRFM options is as near its float32 logits as
    transformers' eager model in the same dtype (whose error sets the scale)."""
    config = CASES["crfm-both"]
    folder = write_options_model(tmp_path, config)
    ours, reference = load_both(folder, config, device, dtype=dtype)
    exact, _ = load_both(folder, config, device)  # float32
    ids = random_ids(config, batch=2, length=12, seed=9).to(device)
    want = exact(ids).logits.float()
    theirs = max_diff(reference(ids).logits, want)
    got = ours(ids).logits
    assert got.dtype == dtype and got.isfinite().all()
    assert 0 < theirs < 1.0
    assert max_diff(got, want) <= 2 * theirs
