"""Prefill, then decode token by token through the KV cache, equals one full forward (issue 2).

The reference is our own full forward without a cache, which test_hf_parity ties to transformers.
"""

from __future__ import annotations

import pytest
import torch

from model.kv_cache import KVCache
from tests.model.hf_reference import LOGIT_TOLERANCE, random_ids
from weights.checkpoint import load_model

MAX_LEN = 24
PAD_ID = 50256


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


@torch.no_grad()
def full_logits(model, sequence: torch.Tensor) -> torch.Tensor:
    return model(sequence[None]).logits[0]  # [T, V]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    diff = (actual - expected).abs().max().item()
    assert diff <= LOGIT_TOLERANCE, f"{what}: max |logit diff| {diff:.3g}"


@torch.no_grad()
def test_single_row_prefill_then_decode(model):
    sequence = random_ids(model.config, batch=1, length=20)[0]  # [20]
    expected = full_logits(model, sequence)  # [20, V]
    cache = KVCache(model.config, max_slots=4, max_len=MAX_LEN)
    cache.allocate(2)
    slot = cache.allocate()[0]  # slot 2: a slot other than 0 must be the one read
    rows = cache.batch([slot])
    prompt_len = 7
    prefill = model(
        sequence[None, :prompt_len], positions=torch.arange(prompt_len)[None], cache=cache, rows=rows
    ).logits[0]  # [7, V]
    assert_close(prefill, expected[:prompt_len], "prefill")
    for t in range(prompt_len, len(sequence)):
        step = model(sequence[None, t:t + 1], positions=torch.tensor([[t]]), cache=cache, rows=rows)
        assert_close(step.logits[0, -1], expected[t], f"decode at position {t}")


PROMPT_LENGTHS = [5, 9, 3]
TOTAL_LENGTH = 16
SLOT_LAYOUTS = {"gather": [3, 0, 2], "view": [1, 2, 3]}


def decode_together(model, cache, rows, sequences, positions: list[int], expected) -> None:
    """Decode every row in one batch, each at its own position, until all reach TOTAL_LENGTH."""
    while min(positions) < TOTAL_LENGTH:
        # Rows that are done keep re-decoding their last token at their last position: a batch
        # stays full, and the check still covers rows at different positions.
        step_positions = [min(p, TOTAL_LENGTH - 1) for p in positions]
        ids = torch.stack([seq[p] for seq, p in zip(sequences, step_positions)])[:, None]  # [B, 1]
        logits = model(ids, positions=torch.tensor(step_positions)[:, None], cache=cache,
                       rows=rows).logits[:, -1]  # [B, V]
        for b, p in enumerate(step_positions):
            assert_close(logits[b], expected[b][p], f"row {b} decode at position {p}")
        positions = [p + 1 for p in positions]


def batch_case(model, layout: str, seed: int):
    """Sequences for the layout's slots, their full-forward logits, an empty cache and rows."""
    slots = SLOT_LAYOUTS[layout]
    sequences = random_ids(model.config, batch=len(slots), length=TOTAL_LENGTH, seed=seed)  # [B, T]
    expected = [full_logits(model, seq) for seq in sequences]
    cache = KVCache(model.config, max_slots=4, max_len=MAX_LEN)
    cache.allocate(cache.max_slots)  # every row with blocks for MAX_LEN positions
    rows = cache.batch(slots)
    assert (rows.span is not None) == (layout == "view")  # the path this case is meant to run
    return slots, sequences, expected, cache, rows


@pytest.mark.parametrize("layout", SLOT_LAYOUTS, ids=SLOT_LAYOUTS.keys())
@torch.no_grad()
def test_rows_prefilled_apart_then_decoded_together(model, layout):
    slots, sequences, expected, cache, rows = batch_case(model, layout, seed=1)
    for b, (slot, n) in enumerate(zip(slots, PROMPT_LENGTHS)):
        prefill = model(sequences[b:b + 1, :n], positions=torch.arange(n)[None], cache=cache,
                        rows=cache.batch([slot]))
        assert_close(prefill.logits[0], expected[b][:n], f"row {b} prefill")
    decode_together(model, cache, rows, sequences, list(PROMPT_LENGTHS), expected)


@pytest.mark.parametrize("layout", SLOT_LAYOUTS, ids=SLOT_LAYOUTS.keys())
@torch.no_grad()
def test_padded_batch_prefill_then_decode(model, layout):
    """One prefill call for prompts of different lengths, right-padded, last-token logits only."""
    slots, sequences, expected, cache, rows = batch_case(model, layout, seed=2)
    width = max(PROMPT_LENGTHS)
    # Padding keys land at positions the decode steps overwrite later; until then the causal
    # mask must hide them from every real token.
    ids = torch.full((len(slots), width), PAD_ID)  # [B, W]
    for b, n in enumerate(PROMPT_LENGTHS):
        ids[b, :n] = sequences[b, :n]
    positions = torch.arange(width).expand(len(slots), width)  # [B, W]
    last = torch.tensor(PROMPT_LENGTHS) - 1  # [B]
    logits = model(ids, positions=positions, cache=cache, rows=rows, logits_index=last).logits
    assert logits.shape == (len(slots), model.config.vocab_size)
    for b, n in enumerate(PROMPT_LENGTHS):
        assert_close(logits[b], expected[b][n - 1], f"row {b} prefill")
    decode_together(model, cache, rows, sequences, list(PROMPT_LENGTHS), expected)

