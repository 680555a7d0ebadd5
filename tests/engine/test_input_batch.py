"""The input batch's device rows (service/engine/input_batch.py): written once per admission, and
nothing written where a slot's rows hold a plain request's values already."""

from __future__ import annotations

import numpy as np
import torch

from model.logits_processors import min_new_tokens_bans
from service.engine.input_batch import InputBatch
from service.engine.requests import RequestState, Sequence
from tests.engine.conftest import make_request

EOS = 3


def start(batch: InputBatch, slot: int, prompt: list[int], **params) -> None:
    state = RequestState(make_request(prompt, **params))
    state.sequences = [Sequence(0, slot, list(prompt), len(prompt))]
    batch.add(state, state.sequences[0])


def test_a_request_without_min_new_tokens_is_never_held_back_by_a_slots_earlier_one():
    batch = InputBatch(max_slots=2, vocab_size=16, max_len=128, eos_token_id=EOS, device=torch.device("cpu"))
    start(batch, 0, [1, 2], min_new_tokens=5)  # slot 0's stop tokens: EOS
    start(batch, 0, [1] * 100)  # a plain request with a long prompt: the slot's rows are plain again
    start(batch, 0, [1, 2, 4])  # a plain one with a short prompt writes nothing
    start(batch, 1, [1, 2], min_new_tokens=5)  # beside a row that uses min_new_tokens
    host = np.array([[0, 1], [0, 1], [3, 2]])  # logits rows, slots, counters
    facts = batch.gather([0, 1], host, torch.from_numpy(host), in_slot_order=True)
    controls = facts.sampling.controls
    bans = min_new_tokens_bans(controls.stop_tokens, controls.new_tokens, controls.min_new_tokens)
    assert not bans[0].any()  # its EOS allowed from its first token
    assert bans[1].nonzero().flatten().tolist() == [EOS]
    # The gather counted one draw on each slot.
    assert batch.lengths([0, 1]).tolist() == [4, 3]
