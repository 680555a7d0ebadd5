"""The running sequences' facts that every step reads on the host, as arrays indexed by KV-cache
slot (a persistent batch, as vLLM's InputBatch keeps its requests): written when a sequence
starts or moves, read for a step's rows with one index (a slice once the batch is packed in slot
order). A step then decides its stops, which optional sampling stages run and its tokens' message
with a few array operations over the batch, not Python per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from service.engine.row_features import FEATURES, HISTORY_BIT, PER_ROW_BIT, RowFeatures, features_of

if TYPE_CHECKING:
    from service.engine.scheduler import RequestState, Sequence


# Columns of the table. LAST: the counter of its last draw (max_new_tokens reached with it); EOS:
# the token that ends it (-1 with ignore_eos); LENGTH: the counter of its next draw,
# len(token_ids) + pending (grown at each launch, set after a drafted step's read).
LAST, PROMPT_LENGTH, EOS, LENGTH = range(4)


@dataclass
class RowFacts:
    """A step's sampled rows, gathered from the slot table at launch (the slots may be reused or
    moved before the step's tokens are read)."""

    features: RowFeatures
    request_ids: list[str]
    indexes: list[int]  # sequence index within the request
    slots: np.ndarray  # [B] the rows' slots
    counters: np.ndarray  # [B] tokens the row's sequence holds when its token is drawn
    # [B, 4] their rows of the slot table (a copy): LAST, PROMPT_LENGTH, EOS, LENGTH; None when the
    # step is read row by row (request_ids and indexes are then empty too).
    table: np.ndarray | None
    # Some row needs Python of its own when its token is read (stop token ids, a draft, a grammar,
    # alternatives): the step's tokens take the per-row path.
    per_row: bool


class SlotRows:
    def __init__(self, max_slots: int) -> None:
        self.table = np.zeros((max_slots, 4), dtype=np.int64)  # [slots, 4]
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
        self._made: dict[tuple[int, int, int], RowFeatures] = {}  # few distinct ones: made once

    def write(self, state: RequestState, seq: Sequence, eos: int) -> None:
        """A sequence starts on its slot."""
        params, slot = state.params, seq.slot
        bits = sum(1 << bit for bit, used in enumerate(features_of(params)) if used)
        if seq.drafter is not None or seq.matcher is not None or params.stop_token_ids or params.top_logprobs > 0:
            bits |= PER_ROW_BIT
        prompt_length = seq.prompt_length
        self.table[slot] = (prompt_length + params.max_new_tokens - 1, prompt_length, -1 if params.ignore_eos else eos,
                            len(seq.token_ids))
        self.seq[slot], self.state[slot] = seq, state
        self.request_id[slot] = state.request.request_id
        self.index[slot] = seq.index
        self.bits[slot], self.ngram[slot], self.top_logprobs[slot] = bits, params.no_repeat_ngram_size, params.top_logprobs

    def move(self, src: int, dst: int) -> None:
        self.table[dst] = self.table[src]
        for column in (self.seq, self.state, self.request_id, self.index, self.bits, self.ngram, self.top_logprobs):
            column[dst] = column[src]

    def decoding(self, in_use: np.ndarray) -> list[int]:
        """The slots, ascending, whose sequences draw their next token by decoding: in use
        (`in_use`: the cache's mask), past their prompt (a first token drawn) and not at their last
        draw already (one the host has not read yet: the core's overlap)."""
        table = self.table
        length = table[:, LENGTH]
        return np.flatnonzero(in_use & (length > table[:, PROMPT_LENGTH]) & (length <= table[:, LAST])).tolist()

    def exhausted(self, in_use: np.ndarray) -> list[RequestState]:
        """The requests a sequence of which drew its last token in a step whose tokens the host has
        not read (the core's overlap): done by length, though not yet known to be."""
        table = self.table
        return [self.state[slot] for slot in np.flatnonzero(in_use & (table[:, LENGTH] > table[:, LAST])).tolist()]

    def lengths(self, slots: list[int]) -> np.ndarray:
        """[B] the counters of the next draws on `slots`."""
        return self.table[slots, LENGTH]

    def drew(self, slots: np.ndarray, in_slot_order: bool) -> None:
        """One token was drawn on each of `slots` (distinct; 0..B-1 when `in_slot_order`)."""
        self.table[slice(0, len(slots)) if in_slot_order else slots, LENGTH] += 1

    def set_length(self, seq: Sequence) -> None:
        self.table[seq.slot, LENGTH] = len(seq.token_ids) + seq.pending

    def gather(self, slots: list[int], slot_array: np.ndarray, counters: np.ndarray, in_slot_order: bool) -> RowFacts:
        """The facts of rows drawing from `slots` (`slot_array`: the same as an array; slots 0..B-1
        when `in_slot_order`: slices), for a step read as a batch."""
        features, per_row = self._features(slots)
        if in_slot_order:
            pick = slice(0, len(slots))
            request_ids, indexes = self.request_id[pick], self.index[pick]
            table = self.table[pick].copy()  # the slots may be moved or reused before the tokens are read
        else:
            request_ids, indexes = list(map(self.request_id.__getitem__, slots)), list(map(self.index.__getitem__, slots))
            table = self.table[slot_array]
        return RowFacts(features, request_ids, indexes, slot_array, counters, table, per_row)

    def gather_features(self, slots: list[int], slot_array: np.ndarray, counters: np.ndarray) -> RowFacts:
        """The same for a step read row by row: the rows' features alone."""
        features, per_row = self._features(slots)
        return RowFacts(features, [], [], slot_array, counters, None, per_row)

    def _features(self, slots: list[int]) -> tuple[RowFeatures, bool]:
        """Which sampling stages the rows on `slots` use, and whether one needs Python of its own."""
        bits = 0
        for row_bits in map(self.bits.__getitem__, slots):
            bits |= row_bits
        ngram = max(map(self.ngram.__getitem__, slots)) if bits & HISTORY_BIT else 0
        top_logprobs = max(map(self.top_logprobs.__getitem__, slots)) if bits & PER_ROW_BIT else 0
        features = self._made.get((bits, ngram, top_logprobs))
        if features is None:
            features = RowFeatures(*(bool(bits >> bit & 1) for bit in range(FEATURES)), max_ngram=ngram,
                                   top_logprobs=top_logprobs)
            if len(self._made) < 4096:
                self._made[bits, ngram, top_logprobs] = features
        return features, bool(bits & PER_ROW_BIT)
