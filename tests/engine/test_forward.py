"""The engine's forward from an offset (service/engine/forward.py), the primitive of chunked
prefill, prefix reuse and speculative verification, against our own full forward without a
cache (which tests/model/test_hf_parity.py ties to transformers)."""

from __future__ import annotations

import pytest
import torch

from model.kv_cache import KVCache
from service.engine.forward import forward_from
from tests.model.hf_reference import random_ids
from tests.model.test_kv_cache_decode import MAX_LEN, assert_close, full_logits
from weights.checkpoint import load_model


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)



@torch.no_grad()
def test_packed_rows_of_different_lengths_continue_their_slots(model):
    """The engine's forward from an offset: rows packed as one run of tokens, each continuing
    its own slot after what an earlier packed call wrote there, equal one full forward."""
    sequences = [random_ids(model.config, batch=1, length=n, seed=n)[0].tolist() for n in (14, 3, 20)]
    splits = [5, 2, 11]  # the first call feeds each row's head, the second its tail
    cache = KVCache(model.config, max_slots=4, max_len=MAX_LEN)
    cache.allocate(cache.max_slots)  # every row with its blocks, as the engine's running rows
    slots = [3, 0, 2]
    heads = forward_from(model, cache, slots, [0, 0, 0], [q[:s] for q, s in zip(sequences, splits)], every_position=True)
    tails = forward_from(model, cache, slots, splits, [q[s:] for q, s in zip(sequences, splits)], every_position=True)
    heads = heads.logits.split(splits)
    tails = tails.logits.split([len(q) - s for q, s in zip(sequences, splits)])
    for i, sequence in enumerate(sequences):
        expected = full_logits(model, torch.tensor(sequence))
        assert_close(torch.cat([heads[i], tails[i]]), expected, f"row {i}")
    last = forward_from(model, cache, [0], [3], [[7]])  # one token at the last row's end
    assert last.logits.shape == (1, model.config.vocab_size)
    assert_close(last.logits[0], full_logits(model, torch.tensor(sequences[1] + [7]))[-1], "one more token")
