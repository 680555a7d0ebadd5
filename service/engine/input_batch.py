"""The persistent input batch (as vLLM's InputBatch): every per-slot value a step reads, indexed by
KV-cache slot, in one place: added when a sequence starts, moved with it when packing moves it,
gathered for a step's rows with one index (a slice once the batch is packed in slot order).

- on the host, the facts every step reads: the counter of the next draw, the prompt's length,
  the counter of the last allowed draw, the EOS that ends it, which sampling stages it uses, who
  holds the slot; a step decides its stops, its sampling stages and its tokens' message with a
  few array operations over them, not Python per row;
- on the device, what the sampler computes with: one float and one integer row per slot (the
  sampling parameters, the seed, the decoding controls' scalars: model/sampling.py,
  model/logits_processors.py), the vocabulary-wide tables of the controls a request uses
  (logit_bias, presence/frequency counts, min_new_tokens' stop tokens, the token history for
  n-grams and bad words, the bad words themselves, the repetition penalty's seen tokens), and the
  last sampled token (`last_tokens`, which a step launched before the host read the previous
  one's tokens feeds).

Each value is stored once. The counts and the history are updated on the device from the step's
sampled tokens (`record`), so no step copies them to or from the host; a table no row of a step
uses is neither gathered nor updated (the rows' features, one OR over their bits).
"""

from __future__ import annotations

import numpy as np
import torch

from model.logits_processors import NO_TOKEN, Controls
from model.lora import BASE
from model.sampling import SamplingTensors
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
    uses_bias,
    uses_counts,
    uses_history,
    uses_min_new,
    uses_none,
)
from service.engine.step_data import LAST, LENGTH, PROMPT_LENGTH, RowFacts
from service.engine.types import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, SamplingParams


# A beam's row in the tables: no sampling stage, no control, nothing to stop on or report.
BEAM_ROW = SamplingParams()
# Columns of the device's float table: the sampling parameters, then the controls' (the order
# Controls.floats has).
TEMPERATURE, TOP_P, PENALTY, DO_SAMPLE, PRESENCE, FREQUENCY, MIN_P, TYPICAL_P = range(8)
# Columns of its integer table. MIN_NEW_END: the counter (tokens held, prompt included) from which
# the sequence may stop, prompt length + min_new_tokens; 0 without min_new_tokens, so that a
# request using no control writes nothing whatever its prompt.
TOP_K, SEED, MIN_NEW_END, NGRAM = range(4)
# A slot's float row and integer row where it decodes greedily and uses no control.
PLAIN_FLOATS = (1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0)


class InputBatch:
    def __init__(self, max_slots: int, vocab_size: int, max_len: int, eos_token_id: int, device: torch.device) -> None:
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.device = device
        self.floats = torch.tensor([PLAIN_FLOATS] * max_slots, device=device)  # [slots, 8]
        self.ints = torch.zeros(max_slots, 4, dtype=torch.long, device=device)  # [slots, 4]
        self.ints[:, TOP_K] = vocab_size
        # The vocabulary-wide tables, each kept up to date only while its slot's sequence uses it
        # (seen: the repetition penalty's prompt and output tokens; stop: min_new_tokens' EOS and
        # stop ids; bad: bad words right-aligned, [NO_TOKEN..., w0, ..., last]).
        self.seen = torch.zeros(max_slots, vocab_size, dtype=torch.bool, device=device)  # [slots, V]
        self.bias = torch.zeros(max_slots, vocab_size, device=device)  # [slots, V]
        self.counts = torch.zeros(max_slots, vocab_size, dtype=torch.int32, device=device)  # [slots, V]
        self.stop = torch.zeros(max_slots, vocab_size, dtype=torch.bool, device=device)  # [slots, V]
        self.history = torch.zeros(max_slots, max_len, dtype=torch.long, device=device)  # [slots, L]
        self.bad = torch.full((max_slots, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), NO_TOKEN, dtype=torch.long, device=device)
        self._device_tables = (self.floats, self.ints, self.seen, self.bias, self.counts, self.stop, self.history,
                               self.bad)
        # Per slot: its float and integer rows hold a plain request's values (greedy, no control),
        # and its control tables neutral ones: the admissions that decode greedily with no control,
        # the most common, write nothing on the device.
        self._plain = [True] * max_slots
        self._neutral = [True] * max_slots
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
        # Each slot's LoRA adapter index (BASE: none): a forward's rows' adapters in one index.
        self.adapter = np.full(max_slots, BASE, dtype=np.int64)
        self._made: dict[tuple[int, int, int], RowFeatures] = {}  # few distinct ones: made once

    def add(self, state: RequestState, seq: Sequence) -> None:
        """A sequence starts on its slot."""
        slot, eos = seq.slot, self.eos_token_id
        # A beam's row is drawn greedily, with no sampling stage, and its draw left unused: its
        # search chooses its token (service/engine/beams.py) and reads it with Python of its own.
        params = state.params if state.beam is None else BEAM_ROW
        self.write_device(slot, params, state.request.prompt_ids, seq.seed)
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
        self.adapter[slot] = seq.adapter

    def write_device(self, slot: int, p: SamplingParams, prompt_ids: list[int], seed: int) -> None:
        """The slot's device rows for a sequence with parameters `p` (`seed`: its own sampling seed,
        in [0, 2^63)): nothing where they hold its values already (a plain request on a plain slot)."""
        neutral = uses_none(p)
        plain = neutral and not p.do_sample and p.repetition_penalty == 1.0
        if plain and self._plain[slot]:
            return
        device, sampling = self.device, p.do_sample
        top_k = min(p.top_k if sampling and p.top_k > 0 else self.vocab_size, self.vocab_size)
        floats = [p.temperature if sampling else 1.0, p.top_p if sampling else 1.0, p.repetition_penalty,
                  float(sampling), p.presence_penalty, p.frequency_penalty, p.min_p, p.typical_p]
        min_new_end = len(prompt_ids) + p.min_new_tokens if p.min_new_tokens else 0
        self.floats[slot] = to_device(floats, device, torch.float32)
        self.ints[slot] = to_device([top_k, seed, min_new_end, p.no_repeat_ngram_size], device, torch.long)
        if p.repetition_penalty != 1.0:
            self.seen[slot] = False
            self.seen[slot, to_device(prompt_ids, device)] = True
        self._plain[slot] = plain
        if neutral and self._neutral[slot]:
            return
        self._neutral[slot] = neutral
        # Bias and bad words are gathered for every row of a batch where any row uses them, so a
        # slot's previous request must leave nothing behind: reset whether this one uses them or not.
        self.bias[slot] = 0.0
        if uses_bias(p):
            ids, values = zip(*p.logit_bias)
            self.bias[slot, to_device(ids, device)] = to_device(values, device, self.bias.dtype)
        if uses_counts(p):
            self.counts[slot] = 0
        if uses_min_new(p):
            stops = list(p.stop_token_ids) + ([] if p.ignore_eos else [self.eos_token_id])
            self.stop[slot] = False
            if stops:
                self.stop[slot, to_device(stops, device)] = True
        if uses_history(p):
            self.history[slot, : len(prompt_ids)] = to_device(prompt_ids, device)
        bad = torch.full((MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), NO_TOKEN, dtype=torch.long)
        for row, word in enumerate(p.bad_words_ids):
            bad[row, MAX_BAD_WORD_TOKENS - len(word) :] = torch.tensor(word)
        self.bad[slot] = to_device(bad, device)

    def hold(self, slot: int, seq: Sequence) -> None:
        """`seq` now holds `slot`, one of its request's (a beam continuing another on its slot:
        every per-slot value but who holds it is its request's, the same on each)."""
        self.seq[slot], self.index[slot] = seq, seq.index

    def move(self, src: int, dst: int) -> None:
        for table in self._device_tables:
            table[dst] = table[src]
        self.last_tokens[dst] = self.last_tokens[src]
        self.table[dst] = self.table[src]
        self.stop_ids[dst] = self.stop_ids[src]
        self.per_row[dst], self.constrained[dst] = self.per_row[src], self.constrained[src]
        self.adapter[dst] = self.adapter[src]
        for column in (self.seq, self.state, self.request_id, self.index, self.bits, self.ngram, self.top_logprobs,
                       self._plain, self._neutral):
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

    def gather(self, slots: list[int], host: np.ndarray, device: torch.Tensor, in_slot_order: bool,
               repeated: bool = False) -> RowFacts:
        """What a step's rows drawing from `slots` read, host and device, and their draws counted.
        `host`: [3, B] their logits rows, slots and counters, `device` the same on the device; slots
        0..B-1 when `in_slot_order` (slices and views then, no gather). `repeated`: a slot is drawn
        from once per row (a draft's 1 + k: its counter is set to what stood once they are read)."""
        bits = 0
        for row_bits in map(self.bits.__getitem__, slots):
            bits |= row_bits
        ngram = max(map(self.ngram.__getitem__, slots)) if bits & HISTORY_BIT else 0
        top_logprobs = max(map(self.top_logprobs.__getitem__, slots)) if bits & ALTERNATIVES_BIT else 0
        f = self._made.get((bits, ngram, top_logprobs))
        if f is None:  # few distinct ones: made once
            f = RowFeatures(*(bool(bits >> bit & 1) for bit in range(FEATURES)), max_ngram=ngram, top_logprobs=top_logprobs)
            if len(self._made) < 4096:
                self._made[bits, ngram, top_logprobs] = f
        # On the host. Copies: the slots may be moved or reused before the tokens are read.
        pick, read = (slice(0, len(slots)), slice(0, len(slots))) if in_slot_order else (host[1], device[1])
        if in_slot_order:
            request_ids, indexes = self.request_id[pick], self.index[pick]
        else:
            request_ids, indexes = list(map(self.request_id.__getitem__, slots)), list(map(self.index.__getitem__, slots))
        table = self.table[pick].copy() if in_slot_order else self.table[pick]  # a fancy index copies
        if repeated:
            np.add.at(self.table[:, LENGTH], host[1], 1)
        else:
            self.table[pick, LENGTH] += 1
        stop_ids = None
        if bits & STOP_IDS_BIT:
            stop_ids = self.stop_ids[pick].copy() if in_slot_order else self.stop_ids[pick]
        wanted = list(map(self.top_logprobs.__getitem__, slots)) if bits & ALTERNATIVES_BIT else None
        # The rows read with Python of their own (a drafter, a beam), and a grammar's.
        own = np.flatnonzero(self.per_row[pick]).tolist() if bits & PER_ROW_BIT else None
        constrained = np.flatnonzero(self.constrained[pick]).tolist() if f.grammar else None
        # On the device: one index per table the rows use.
        floats, ints, counters = self.floats[read], self.ints[read], device[2]  # [B, 8], [B, 4], [B]
        sampling = SamplingTensors(floats[:, TEMPERATURE], ints[:, TOP_K], floats[:, TOP_P], floats[:, PENALTY],
                                   floats[:, DO_SAMPLE] > 0, ints[:, SEED], f.sample, f.top_k_top_p, f.penalty)
        if f.controls:
            # min_new_tokens counted from the sequence's first token, shifted by the prompt's length.
            sampling.controls = Controls(
                bias=self.bias[read] if f.bias else None, counts=self.counts[read] if f.counts else None,
                floats=floats[:, PRESENCE:], new_tokens=counters if f.min_new else None,
                min_new_tokens=ints[:, MIN_NEW_END] if f.min_new else None,
                stop_tokens=self.stop[read] if f.min_new else None, history=self.history[read] if f.history else None,
                lengths=counters if f.history else None, ngram=ints[:, NGRAM] if f.history else None,
                max_ngram=f.max_ngram if f.history else 0, bad=self.bad[read] if f.history and f.bad_words else None,
                warpers=f.warpers)
        return RowFacts(f, request_ids, indexes, host[1], host[2], table, stop_ids, wanted, own, constrained, sampling,
                        self.seen[read] if f.penalty else None)

    def record(self, sampling: SamplingTensors, slots: torch.Tensor, counters: torch.Tensor, tokens: torch.Tensor) -> None:
        """The step's sampled tokens [B] join the seen tokens, counts and histories its rows use."""
        if sampling.any_penalty:
            self.seen[slots, tokens] = True
        controls = sampling.controls
        if controls is not None and controls.counts is not None:
            self.counts[slots, tokens] += 1
        if controls is not None and controls.history is not None:
            self.history[slots, counters] = tokens
