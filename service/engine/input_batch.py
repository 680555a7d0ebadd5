"""The persistent input batch (as vLLM's InputBatch): every per-slot value a step reads, indexed by
KV-cache slot, in one place: added when a sequence starts, moved with it when packing moves it,
gathered for a step's rows with one index (a slice once the batch is packed in slot order).

- on the host, the facts every step reads: the counter of the next draw, the prompt's length,
  the counter of the last allowed draw, the EOS that ends it, which sampling stages it uses, who
  holds the slot; a step decides its stops, its sampling stages and its tokens' message with a
  few array operations over them, not Python per row;
- on the device, its sampling parameters (slot_params.py), its decoding controls
  (slot_controls.py) and its last sampled token (`last_tokens`, which a step launched before the
  host read the previous one's tokens feeds).

Each value is stored once; the device tables hold only what the device computes with.
"""

from __future__ import annotations

import numpy as np
import torch

from model.transfer import to_device
from service.engine.requests import RequestState, Sequence
from service.engine.row_features import (
    ALTERNATIVES_BIT,
    FEATURES,
    HISTORY_BIT,
    MAX_STOP_IDS,
    PER_ROW_BIT,
    STOP_IDS_BIT,
    RowFeatures,
    features_of,
)
from service.engine.slot_controls import SlotControls
from service.engine.slot_params import SlotParams
from service.engine.step_data import EOS, LAST, LENGTH, PROMPT_LENGTH, RowFacts
from service.engine.types import SamplingParams


# A beam's row in the tables: no sampling stage, no control, nothing to stop on or report.
BEAM_ROW = SamplingParams()


class InputBatch:
    def __init__(self, max_slots: int, vocab_size: int, max_len: int, eos_token_id: int, device: torch.device) -> None:
        self.eos_token_id = eos_token_id
        self.params = SlotParams(max_slots, vocab_size, device)
        self.controls = SlotControls(max_slots, vocab_size, max_len, eos_token_id, device)
        # Each slot's last sampled token, on the device: what a step launched before the host
        # read the previous one's tokens feeds.
        self.last_tokens = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.table = np.zeros((max_slots, 4), dtype=np.int64)  # [slots, 4]: step_data's columns
        # Who holds each slot (stale once it ends: read only for the slots of running sequences).
        self.seq: list[Sequence | None] = [None] * max_slots
        self.state: list[RequestState | None] = [None] * max_slots
        self.request_id = [""] * max_slots
        self.index = [0] * max_slots
        # Which sampling stages it uses (bit i: features_of(params)[i], PER_ROW_BIT), and the two
        # counts RowFeatures takes the largest of.
        self.bits = [0] * max_slots
        self.ngram = [0] * max_slots
        self.top_logprobs = [0] * max_slots
        self.stop_ids = np.full((max_slots, MAX_STOP_IDS), -1, dtype=np.int64)  # [slots, K]: -1 pads
        # PER_ROW_BIT of `bits` as an array, and whether a grammar constrains it: a step finds its
        # few such rows without Python per row.
        self.per_row = np.zeros(max_slots, dtype=bool)
        self.constrained = np.zeros(max_slots, dtype=bool)
        self._made: dict[tuple[int, int, int], RowFeatures] = {}  # few distinct ones: made once

    def add(self, state: RequestState, seq: Sequence) -> None:
        """A sequence starts on its slot."""
        slot, eos = seq.slot, self.eos_token_id
        # A beam's row is drawn greedily, with no sampling stage, and its draw left unused: its
        # search chooses its token (service/engine/beams.py) and reads it with Python of its own.
        params = state.params if state.beam is None else BEAM_ROW
        prompt = state.request.prompt_ids
        self.params.write(slot, params, prompt, seq.seed)
        self.controls.write(slot, params, prompt)
        bits = sum(1 << bit for bit, used in enumerate(features_of(params)) if used)
        stops = params.stop_token_ids
        if seq.drafter is not None or state.beam is not None or len(stops) > MAX_STOP_IDS:
            bits |= PER_ROW_BIT
        if params.top_logprobs > 0:
            bits |= ALTERNATIVES_BIT
        if stops or self.bits[slot] & STOP_IDS_BIT:  # gathered with a neighbour's: none may be left over
            self.stop_ids[slot] = -1
            if stops and len(stops) <= MAX_STOP_IDS:
                self.stop_ids[slot, : len(stops)] = stops
                bits |= STOP_IDS_BIT
        prompt_length, own = seq.prompt_length, state.params
        self.table[slot] = (prompt_length + own.max_new_tokens - 1, prompt_length, -1 if own.ignore_eos else eos,
                            len(seq.token_ids))
        self.seq[slot], self.state[slot] = seq, state
        self.request_id[slot] = state.request.request_id
        self.index[slot] = seq.index
        self.bits[slot], self.ngram[slot], self.top_logprobs[slot] = bits, params.no_repeat_ngram_size, params.top_logprobs
        self.per_row[slot], self.constrained[slot] = bool(bits & PER_ROW_BIT), seq.matcher is not None

    def hold(self, slot: int, seq: Sequence) -> None:
        """`seq` now holds `slot`, one of its request's (a beam continuing another on its slot:
        every per-slot value but who holds it is its request's, the same on each)."""
        self.seq[slot], self.index[slot] = seq, seq.index

    def move(self, src: int, dst: int) -> None:
        self.params.move(src, dst)
        self.controls.move(src, dst)
        self.last_tokens[dst] = self.last_tokens[src]
        self.table[dst] = self.table[src]
        self.stop_ids[dst] = self.stop_ids[src]
        self.per_row[dst], self.constrained[dst] = self.per_row[src], self.constrained[src]
        for column in (self.seq, self.state, self.request_id, self.index, self.bits, self.ngram, self.top_logprobs):
            column[dst] = column[src]

    def decoding(self, in_use: np.ndarray, sitting_out: list[int] = ()) -> list[int]:
        """The slots, ascending, whose sequences draw their next token by decoding: in use
        (`in_use`: the cache's mask), past their prompt (a first token drawn), not at their last
        draw already (one the host has not read yet: the core's overlap) and not sitting the step
        out (`sitting_out`: a host-paced sequence whose last token is unread)."""
        table = self.table
        length = table[:, LENGTH]
        mask = in_use & (length > table[:, PROMPT_LENGTH]) & (length <= table[:, LAST])
        if sitting_out:
            mask[sitting_out] = False
        return np.flatnonzero(mask).tolist()

    def exhausted(self, in_use: np.ndarray) -> list[RequestState]:
        """The requests a sequence of which drew its last token in a step whose tokens the host has
        not read (the core's overlap): done by length, though not yet known to be."""
        table = self.table
        return [self.state[slot] for slot in np.flatnonzero(in_use & (table[:, LENGTH] > table[:, LAST])).tolist()]

    def lengths(self, slots: list[int]) -> np.ndarray:
        """[B] the counters of the next draws on `slots`."""
        return self.table[slots, LENGTH]

    def drew(self, slots: np.ndarray, in_slot_order: bool, repeated: bool = False) -> None:
        """One token was drawn on each of `slots` (distinct, 0..B-1 when `in_slot_order`; with
        `repeated`, a slot once per row: a draft's 1 + k, set to what stood once they are read)."""
        if repeated:
            np.add.at(self.table[:, LENGTH], slots, 1)
        else:
            self.table[slice(0, len(slots)) if in_slot_order else slots, LENGTH] += 1

    def set_drafted(self, sequences: list[Sequence]) -> None:
        """What a drafted step left (its lengths are known once its tokens are read): each
        sequence's counter and last token. A sequence that left its slot since the step launched
        (cancelled, ended) is skipped: the slot may hold another sequence now (a packing move)."""
        sequences = [seq for seq in sequences if self.seq[seq.slot] is seq]
        if not sequences:
            return
        for seq in sequences:
            self.table[seq.slot, LENGTH] = len(seq.token_ids) + seq.pending
        device = self.last_tokens.device
        self.last_tokens[to_device([s.slot for s in sequences], device)] = to_device([s.token_ids[-1] for s in sequences], device)

    def gather(self, slots: list[int], slot_array: np.ndarray, counters: np.ndarray, in_slot_order: bool) -> RowFacts:
        """The facts of rows drawing from `slots` (`slot_array`: the same as an array; slots 0..B-1
        when `in_slot_order`: slices), for a step read as a batch."""
        features, bits = self._features(slots)
        # Copies: the slots may be moved or reused before the tokens are read.
        pick = slice(0, len(slots)) if in_slot_order else slot_array
        if in_slot_order:
            request_ids, indexes = self.request_id[pick], self.index[pick]
        else:
            request_ids, indexes = list(map(self.request_id.__getitem__, slots)), list(map(self.index.__getitem__, slots))
        table = self.table[pick].copy() if in_slot_order else self.table[pick]  # a fancy index copies
        stop_ids = None
        if bits & STOP_IDS_BIT:
            stop_ids = self.stop_ids[pick].copy() if in_slot_order else self.stop_ids[pick]
        wanted = list(map(self.top_logprobs.__getitem__, slots)) if bits & ALTERNATIVES_BIT else None
        # The rows read with Python of their own (a drafter), the others as a batch; a grammar's.
        own = np.flatnonzero(self.per_row[pick]).tolist() if bits & PER_ROW_BIT else None
        constrained = np.flatnonzero(self.constrained[pick]).tolist() if features.grammar else None
        return RowFacts(features, request_ids, indexes, slot_array, counters, table, stop_ids, wanted, own, constrained)

    def gather_features(self, slots: list[int], slot_array: np.ndarray, counters: np.ndarray) -> RowFacts:
        """The same for a step read row by row: the rows' features alone."""
        features, bits = self._features(slots)
        wanted = list(map(self.top_logprobs.__getitem__, slots)) if bits & ALTERNATIVES_BIT else None
        return RowFacts(features, [], [], slot_array, counters, None, wanted=wanted)

    def _features(self, slots: list[int]) -> tuple[RowFeatures, int]:
        """Which sampling stages the rows on `slots` use, and all their bits together."""
        bits = 0
        for row_bits in map(self.bits.__getitem__, slots):
            bits |= row_bits
        ngram = max(map(self.ngram.__getitem__, slots)) if bits & HISTORY_BIT else 0
        top_logprobs = max(map(self.top_logprobs.__getitem__, slots)) if bits & ALTERNATIVES_BIT else 0
        features = self._made.get((bits, ngram, top_logprobs))
        if features is None:
            features = RowFeatures(*(bool(bits >> bit & 1) for bit in range(FEATURES)), max_ngram=ngram,
                                   top_logprobs=top_logprobs)
            if len(self._made) < 4096:
                self._made[bits, ngram, top_logprobs] = features
        return features, bits
