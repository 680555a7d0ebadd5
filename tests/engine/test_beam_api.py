"""model/beam.py's API: input checks, the first step, and KV-cache slots in beam_generate."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from model.beam import BeamParams, BeamSearch, beam_generate
from model.kv_cache import KVCache
from model.scoring import top_n, top_nonpositive


def test_first_step_accepts_one_row_or_every_beam(tiny_model):
    logits = tiny_model(torch.tensor([[464, 2068, 7586]], device=tiny_model.device)).logits[:, -1]  # [1, V]
    params = BeamParams(num_beams=3, max_new_tokens=4)
    one_row = BeamSearch(params, [464, 2068, 7586]).step(logits)
    every_beam = BeamSearch(params, [464, 2068, 7586]).step(logits.expand(3, -1))
    assert one_row == every_beam
    # The first step expands beam 0 only (the others start at -1e9).
    assert one_row.source_beams == [0, 0, 0]
    assert one_row.next_tokens == logits[0].topk(3).indices.tolist()


def test_beam_generate_frees_its_slots_on_a_shared_cache(tiny_model, monkeypatch):
    cache = KVCache(tiny_model.config, max_slots=6, max_len=32, device=tiny_model.device)
    [other] = cache.allocate(1)  # another sequence's row: beam_generate must leave it alone
    assert cache.ensure(other, 32)
    size = cache.block_size
    others = torch.cat([torch.arange(block * size, (block + 1) * size) for block in cache.blocks_of(other)])
    cache.kv[:, :, :, others] = 7.0  # its blocks' positions, keys and values
    params = BeamParams(num_beams=5, eos_token_id=50256, max_new_tokens=6)
    beam_generate(tiny_model, [464, 2068], params, cache=cache)
    assert cache.slots_used == 1

    with pytest.raises(ValueError, match="max_len"):
        beam_generate(tiny_model, [464, 2068], replace(params, max_new_tokens=40), cache=cache)
    assert cache.slots_used == 1

    def broken_copy(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(cache, "copy_slots", broken_copy)
    with pytest.raises(RuntimeError, match="device lost"):
        beam_generate(tiny_model, [464, 2068], params, cache=cache)
    assert cache.slots_used == 1 and cache.slots_free == 5
    assert bool((cache.kv[:, :, :, others] == 7.0).all())  # never written by the beams
    cache.free(other)  # still allocated: raises if beam_generate had freed it


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_beams=1), "num_beams must be at least 2"),
        (dict(num_beams=3, num_return_sequences=4), "num_return_sequences must be in"),
        (dict(num_beams=3, num_return_sequences=0), "num_return_sequences must be in"),
        (dict(num_beams=2, max_new_tokens=0), "max_new_tokens must be at least 1"),
        (dict(num_beams=2, early_stopping="always"), "early_stopping must be"),
        (dict(num_beams=2, length_penalty=float("nan")), "length_penalty must be finite"),
        (dict(num_beams=2, repetition_penalty=0.0), "repetition_penalty must be a positive"),
    ],
)
def test_invalid_params_are_rejected_with_a_reason(fields, message):
    with pytest.raises(ValueError, match=message):
        BeamParams(**fields)


def test_step_checks_logit_shape_and_order_of_calls():
    params = BeamParams(num_beams=2, max_new_tokens=1)
    search = BeamSearch(params, [1, 2])
    with pytest.raises(RuntimeError, match="not done"):
        search.finish()
    with pytest.raises(ValueError, match=r"expected logits \[num_beams=2, vocab\]"):
        search.step(torch.zeros(3, 10))
    step = search.step(torch.arange(10.0)[None, :])  # [1, V]
    assert step.done  # max_new_tokens=1
    with pytest.raises(RuntimeError, match="done"):
        search.step(torch.zeros(2, 10))
    best = search.finish()
    assert [h.token_ids for h in best] == [[9]] and best[0].finish_reason == "length"
    assert best[0].score == pytest.approx(float(torch.log_softmax(torch.arange(10.0), 0)[9]))
    with pytest.raises(ValueError, match="prompt"):
        BeamSearch(params, [])


def test_the_beams_top_k_over_values_at_most_zero_ranks_as_top_n():
    """top_nonpositive (the beams' candidates: log-probs and their sums, never above 0) gives
    top_n's answer for such values: ties lowest index first, 0.0 and -0.0 equal and largest,
    -inf last, subnormals ordered; any k."""
    generator = torch.Generator().manual_seed(2)
    for _ in range(30):
        values = -torch.randint(0, 8, (5, 600), generator=generator).float() * 0.25  # many ties, zeros
        values[0, 100:130:2], values[0, 101:130:2] = -0.0, 0.0
        values[1] = float("-inf")
        values[1, [9, 400]] = -3.0
        values[2] = -torch.rand(600, generator=generator) * 1e3
        values[3] = -torch.rand(600, generator=generator) * 1e-38  # subnormals
        values[4] = -torch.rand(600, generator=generator)
        for k in (1, 12, 600):
            expected, found = top_n(values, k), top_nonpositive(values, k)
            assert torch.equal(found[1], expected[1]) and torch.equal(found[0], expected[0])
