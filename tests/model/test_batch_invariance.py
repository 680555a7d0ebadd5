"""A row's logits do not depend on its batch on CPU: prefilled packed beside rows of other
lengths, and decoded beside rows that read more keys, each row's logits are bit-identical to
the same row run alone, for float, int8 and int4 weights alike (docs/batch-invariance.md).
Nor on how its tokens were computed: a prompt prefilled cold, from a cached prefix, in chunks of
any size or a token at a time as decoding runs gives the same logits and keys and values."""

from __future__ import annotations

import pytest
import torch

from model.kv_cache import KVCache
from model.quantized import quantize_problem
from service.engine.forward import forward_from
from tests.model.checkpoint_options import CASES, write_options_model
from tests.model.hf_reference import random_ids
from weights.checkpoint import load_model

# Prompt lengths: one token, under and over a vector of 8 floats, and more than 32 keys.
LENGTHS = [1, 3, 10, 17, 40]
DECODE_STEPS = 4
# Batches, as indices into LENGTHS: the row alone, then beside shorter and longer rows.
BATCHES = [[0, 1], [2, 4], [3, 1, 4], [4, 2, 0, 3], [1, 2, 3, 4, 0]]


@pytest.fixture(scope="module", params=["none", "int8", "int4", "checkpoint-options"])
def model(request, tiny_model_dir, tmp_path_factory):
    if request.param == "checkpoint-options":  # CRFM's scale per layer, exact GELU run after its product
        config = CASES["crfm-both"].with_(activation_function="gelu")
        return load_model(write_options_model(tmp_path_factory.mktemp("options"), config))
    problem = quantize_problem(request.param, "cpu", torch.float32)
    if problem is not None:
        pytest.skip(problem)
    model = load_model(tiny_model_dir)
    model.quantize(request.param)
    return model


@torch.inference_mode()
def run_batch(model, prompts: list[list[int]], slots: list[int]) -> list[list[torch.Tensor]]:
    """Per row: its prefill logits [n, V], then one [V] per decode step (greedy, as the engine
    decodes: one packed prefill forward, then [B, 1] forwards over the cache)."""
    cache = KVCache(model.config, max_slots=max(slots) + 1, max_len=64)
    cache.allocate(cache.max_slots)  # every row with its blocks, as the engine's running rows
    prefill = forward_from(model, cache, slots, [0] * len(prompts), prompts, every_position=True).logits  # [N, V]
    per_row = [[logits] for logits in prefill.split([len(p) for p in prompts])]
    tokens = [row[0][-1].argmax().item() for row in per_row]
    lengths = [len(p) for p in prompts]
    for _ in range(DECODE_STEPS):
        out = model(
            torch.tensor([[token] for token in tokens]),
            torch.tensor([[length] for length in lengths]),
            cache,
            cache.batch(slots),
            kv_length=max(lengths) + 1,
        ).logits[:, -1]  # [B, V]
        for row, logits in zip(per_row, out):
            row.append(logits)
        tokens = out.argmax(-1).tolist()
        lengths = [length + 1 for length in lengths]
    return per_row


def test_each_rows_logits_are_the_same_alone_and_in_any_batch(model):
    prompts = [random_ids(model.config, batch=1, length=n, seed=n)[0].tolist() for n in LENGTHS]
    alone = [run_batch(model, [prompt], [0])[0] for prompt in prompts]
    for batch in BATCHES:
        # Slots in reverse: the cache is gathered, not read through a view as a lone row's is.
        together = run_batch(model, [prompts[i] for i in batch], list(range(len(batch)))[::-1])
        for i, row in zip(batch, together):
            for step, (got, expected) in enumerate(zip(row, alone[i])):
                assert torch.equal(got, expected), (batch, LENGTHS[i], step, float((got - expected).abs().max()))


# How a 40-token prompt's positions are split into forwards: the cut points between them. A cached
# prefix is a first forward that another request ran (the engine reuses its keys and values).
SPLITS = {
    "cached prefix of 1": [1],
    "cached prefix of 32": [32],
    "all but the last token cached": [39],
    "budget 5": list(range(5, 40, 5)),
    "budget 16": [16, 32],
    "uneven chunks": [3, 4, 17, 30],
}


@torch.inference_mode()
def run_in_pieces(model, prompt: list[int], cuts: list[int], rest: str = "prefill"):
    """Every position's logits [n, V] and the keys and values [layers, 2, H, n, d_h] of `prompt` fed
    in prefill forwards ending at `cuts`, then the rest as one more prefill forward, a token per
    [1, 1] decode forward ("decode") or one draft's verification ("verify"). In slot 1 of 2, beside
    a slot holding other keys; 50 positions, so the last query block's keys stop short."""
    cache = KVCache(model.config, max_slots=2, max_len=50)
    cache.allocate(cache.max_slots)  # every row with its blocks, as the engine's running rows
    forward_from(model, cache, [0], [0], [list(reversed(prompt))])
    last_cut = cuts[-1] if cuts else 0
    ends = [*cuts, *range(last_cut + 1, len(prompt) + 1)] if rest == "decode" else [*cuts, len(prompt)]
    logits, start = [], 0
    for end in ends:
        if rest == "decode" and start >= last_cut:
            out = model(torch.tensor([prompt[start:end]]), torch.tensor([[start]]), cache, cache.batch([1]),
                        kv_length=end).logits[0]  # [1, V]
        else:
            out = forward_from(model, cache, [1], [start], [prompt[start:end]], every_position=True,
                               one_query_per_call=rest == "verify" and start >= last_cut).logits  # [n, V]
        logits.append(out)
        start = end
    size = cache.block_size  # slot 1's positions in the block pool
    positions = torch.cat([torch.arange(block * size, (block + 1) * size) for block in cache.blocks_of(1)])
    return torch.cat(logits), cache.kv[:, :, :, positions[: len(prompt)]].clone()


def assert_same(got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor], name: str) -> None:
    (logits, kv), (expected_logits, expected_kv) = got, expected
    assert torch.equal(kv, expected_kv), (name, float((kv - expected_kv).abs().max()))
    assert torch.equal(logits, expected_logits), (name, float((logits - expected_logits).abs().max()))


def test_a_prompt_gives_the_same_bits_cold_from_a_cached_prefix_and_in_chunks_of_any_size(model):
    prompt = random_ids(model.config, batch=1, length=40, seed=7)[0].tolist()
    cold = run_in_pieces(model, prompt, [])
    for name, cuts in SPLITS.items():
        assert_same(run_in_pieces(model, prompt, cuts), cold, name)


def test_a_verified_draft_gives_decodings_bits(model):
    prompt = random_ids(model.config, batch=1, length=40, seed=8)[0].tolist()
    assert_same(run_in_pieces(model, prompt, [31], rest="verify"), run_in_pieces(model, prompt, [31], rest="decode"),
                "verified from 31")
