"""Each KV-cache slot's decoding controls (model/logits_processors.py) as device tables, written
once at admission, gathered by slot each step: logit_bias, presence/frequency penalties,
min_new_tokens with stop_token_ids, no_repeat_ngram_size, bad_words_ids, min_p, typical_p.

The token history (for n-grams and bad words) and the output counts (for presence/frequency)
are updated on the device from the step's sampled tokens, so no step copies them to or from
the host. Tables a batch does not use are neither gathered nor updated (the rows' features, one
OR over the slot table's bits: service/engine/slot_rows.py).
"""

from __future__ import annotations

import torch

from model.logits_processors import NO_TOKEN, Controls
from model.transfer import to_device
from service.engine.types import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, SamplingParams

from service.engine.row_features import RowFeatures, uses_bias, uses_counts, uses_history, uses_min_new, uses_none


# Columns of the float table (the order Controls.floats has).
PRESENCE, FREQUENCY, MIN_P, TYPICAL_P = range(4)
# Columns of the integer table. MIN_NEW_END: the counter (tokens held, prompt included) from which
# the sequence may stop, prompt length + min_new_tokens (the prompt's length itself is the input
# batch's, on the host).
MIN_NEW_END, NGRAM = range(2)


class SlotControls:
    def __init__(self, max_slots: int, vocab_size: int, max_len: int, eos_token_id: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.device = device
        self._floats = torch.zeros(max_slots, 4, device=device)  # [slots, 4]
        self._floats[:, TYPICAL_P] = 1.0
        self._ints = torch.zeros(max_slots, 2, dtype=torch.long, device=device)  # [slots, 2]
        self._bias = torch.zeros(max_slots, vocab_size, device=device)  # [slots, V]
        self._counts = torch.zeros(max_slots, vocab_size, dtype=torch.int32, device=device)  # [slots, V]
        self._stop = torch.zeros(max_slots, vocab_size, dtype=torch.bool, device=device)  # [slots, V]
        self._history = torch.zeros(max_slots, max_len, dtype=torch.long, device=device)  # [slots, L]
        self._bad = torch.full((max_slots, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), NO_TOKEN, dtype=torch.long, device=device)
        self._tables = (self._floats, self._ints, self._bias, self._counts, self._stop, self._history, self._bad)
        # Per slot: its rows hold no control's values (what a request using none needs, so most
        # admissions write nothing here).
        self._neutral = [True] * max_slots

    def write(self, slot: int, p: SamplingParams, prompt_ids: list[int]) -> None:
        neutral = uses_none(p)
        if neutral and self._neutral[slot]:
            return
        self._neutral[slot] = neutral
        self._floats[slot] = to_device([p.presence_penalty, p.frequency_penalty, p.min_p, p.typical_p], self.device, torch.float32)
        self._ints[slot] = to_device([len(prompt_ids) + p.min_new_tokens, p.no_repeat_ngram_size], self.device, self._ints.dtype)
        # Bias and bad words are gathered for every row of a batch where any row uses them, so a
        # slot's previous request must leave nothing behind: reset whether this one uses them or not.
        self._bias[slot] = 0.0
        if uses_bias(p):
            ids, values = zip(*p.logit_bias)
            self._bias[slot, to_device(ids, self.device)] = to_device(values, self.device, self._bias.dtype)
        if uses_counts(p):
            self._counts[slot] = 0
        if uses_min_new(p):
            stops = list(p.stop_token_ids) + ([] if p.ignore_eos else [self.eos_token_id])
            self._stop[slot] = False
            if stops:
                self._stop[slot, to_device(stops, self.device)] = True
        if uses_history(p):
            self._history[slot, : len(prompt_ids)] = to_device(prompt_ids, self.device)
        # Right-aligned: [NO_TOKEN..., w0, w1, ..., last]
        table = torch.full((MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), NO_TOKEN, dtype=torch.long)
        for row, word in enumerate(p.bad_words_ids):
            table[row, MAX_BAD_WORD_TOKENS - len(word) :] = torch.tensor(word)
        self._bad[slot] = to_device(table, self.device)

    def move(self, src: int, dst: int) -> None:
        for table in self._tables:
            table[dst] = table[src]
        self._neutral[dst] = self._neutral[src]

    def gather(self, slots: torch.Tensor | slice, counters: torch.Tensor, features: RowFeatures) -> Controls | None:
        """Controls of the rows using `slots` [B] (or a slice of the first B: views) holding
        `counters` [B] tokens; None if no row has any. `features`: which of them those rows use."""
        f = features
        if not f.controls:
            return None
        ints = self._ints[slots]  # [B, 2]
        return Controls(
            bias=self._bias[slots] if f.bias else None,
            counts=self._counts[slots] if f.counts else None,
            floats=self._floats[slots],
            # Both counted from the sequence's first token: new tokens < min_new_tokens, shifted
            # by the prompt's length.
            new_tokens=counters if f.min_new else None,
            min_new_tokens=ints[:, MIN_NEW_END] if f.min_new else None,
            stop_tokens=self._stop[slots] if f.min_new else None,
            history=self._history[slots] if f.history else None,
            lengths=counters if f.history else None,
            ngram=ints[:, NGRAM] if f.history else None,
            max_ngram=f.max_ngram if f.history else 0,
            bad=self._bad[slots] if f.history and f.bad_words else None,
            warpers=f.warpers,
        )

    def record(self, controls: Controls | None, slots: torch.Tensor, counters: torch.Tensor, tokens: torch.Tensor) -> None:
        """The step's sampled tokens [B] join the counts and histories that its rows use."""
        if controls is None:
            return
        if controls.counts is not None:
            self._counts[slots, tokens] += 1
        if controls.history is not None:
            self._history[slots, counters] = tokens
