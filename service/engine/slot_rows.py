"""The running sequences' facts that every step reads on the host, as arrays indexed by KV-cache
slot (a persistent batch, as vLLM's InputBatch keeps its requests): written when a sequence
starts or moves, read for a step's rows with one index (a slice once the batch is packed in slot
order). A step then decides its stops, which optional sampling stages run and its tokens' message
with a few array operations over the batch, not Python per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.engine.slot_controls import uses_bias, uses_counts, uses_history, uses_min_new, uses_warpers
from service.engine.types import SamplingParams


def features_of(p: SamplingParams) -> tuple[bool, ...]:
    """Which optional stage of the sampler a row uses, in RowFeatures' field order."""
    return (
        p.do_sample,
        p.do_sample and (p.top_k > 0 or p.top_p < 1.0),
        p.repetition_penalty != 1.0,
        uses_bias(p),
        uses_counts(p),
        uses_history(p),
        uses_min_new(p),
        uses_warpers(p),
        bool(p.bad_words_ids),
        p.grammar is not None,
    )


@dataclass(frozen=True)
class RowFeatures:
    """Whether any row of a step uses each optional stage (the sampler skips the others)."""

    sample: bool
    top_k_top_p: bool
    penalty: bool
    bias: bool
    counts: bool
    history: bool
    min_new: bool
    warpers: bool
    bad_words: bool
    grammar: bool
    max_ngram: int = 0  # the longest no_repeat_ngram_size among them
    top_logprobs: int = 0  # the most alternatives any of them asked for

    @property
    def controls(self) -> bool:
        return self.bias or self.counts or self.history or self.min_new or self.warpers


FEATURES = len(RowFeatures.__dataclass_fields__) - 2  # the flags, before max_ngram and top_logprobs
NO_FEATURES = RowFeatures(*[False] * FEATURES)


@dataclass
class RowFacts:
    """A step's sampled rows, gathered from the slot tables at launch (the slots may be reused or
    moved before the step's tokens are read)."""

    features: RowFeatures
    request_ids: list[str]
    indexes: list[int]  # sequence index within the request
    counters: np.ndarray  # [B] tokens the row's sequence holds when its token is drawn
    limit: np.ndarray  # [B] token count at which the sequence ends by length
    prompt_length: np.ndarray  # [B]
    eos_ends: np.ndarray  # [B] EOS ends it (not ignore_eos)
    # Some row needs Python of its own when its token is read (stop token ids, a draft, a grammar,
    # alternatives): the step's tokens take the per-row path.
    per_row: bool


class SlotRows:
    def __init__(self, max_slots: int) -> None:
        self.features = np.zeros(max_slots, dtype=np.int64)  # bit i: features_of(params)[i]
        self.ngram = np.zeros(max_slots, dtype=np.int64)
        self.top_logprobs = np.zeros(max_slots, dtype=np.int64)
        self.limit = np.zeros(max_slots, dtype=np.int64)
        self.prompt_length = np.zeros(max_slots, dtype=np.int64)
        self.eos_ends = np.zeros(max_slots, dtype=bool)
        self.per_row = np.zeros(max_slots, dtype=bool)
        self.request_id = [""] * max_slots
        self.index = [0] * max_slots
        self._arrays = (self.features, self.ngram, self.top_logprobs, self.limit, self.prompt_length, self.eos_ends,
                        self.per_row)

    def write(self, slot: int, request_id: str, index: int, params: SamplingParams, prompt_length: int,
              per_row: bool) -> None:
        """`per_row`: its tokens need Python of their own (a drafter, a grammar's matcher)."""
        self.features[slot] = sum(1 << bit for bit, used in enumerate(features_of(params)) if used)
        self.ngram[slot] = params.no_repeat_ngram_size
        self.top_logprobs[slot] = params.top_logprobs
        self.limit[slot] = prompt_length + params.max_new_tokens
        self.prompt_length[slot] = prompt_length
        self.eos_ends[slot] = not params.ignore_eos
        self.per_row[slot] = per_row or bool(params.stop_token_ids) or params.top_logprobs > 0
        self.request_id[slot] = request_id
        self.index[slot] = index

    def move(self, src: int, dst: int) -> None:
        for array in self._arrays:
            array[dst] = array[src]
        self.request_id[dst] = self.request_id[src]
        self.index[dst] = self.index[src]

    def gather(self, slots: list[int], slot_array: np.ndarray, counters: np.ndarray, in_slot_order: bool) -> RowFacts:
        """The facts of rows drawing from `slots` (`slot_array`: the same as an array; slots 0..B-1
        when `in_slot_order`: slices)."""
        if in_slot_order:
            pick = slice(0, len(slots))
            request_ids, indexes = self.request_id[pick], self.index[pick]
        else:
            pick = slot_array
            request_ids, indexes = list(map(self.request_id.__getitem__, slots)), list(map(self.index.__getitem__, slots))
        if slots:
            bits = int(np.bitwise_or.reduce(self.features[pick]))
            features = RowFeatures(*(bool(bits >> bit & 1) for bit in range(FEATURES)),
                                   max_ngram=int(self.ngram[pick].max()), top_logprobs=int(self.top_logprobs[pick].max()))
        else:
            features = NO_FEATURES
        # Copies: the slots may be moved or given to another sequence before the tokens are read.
        return RowFacts(features, request_ids, indexes, counters, self.limit[pick].copy(),
                        self.prompt_length[pick].copy(), self.eos_ends[pick].copy(),
                        bool(slots) and bool(self.per_row[pick].any()))
