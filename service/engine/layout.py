"""Where a step's rows go: which sequences decode, in which rows of the logits, which rows the
sampler draws for, and the index vectors the device needs, all decided before any forward is
queued (on CUDA a host→device copy waits for queued work, so making them after the forwards were
launched would stall the host until they finish).

Two ways to the same layout: from the input batch's arrays (service/engine/input_batch.py) when
enough run for array operations to pay (grammars, drafters, beam searches and the sequences
verifying a draft among them: those sequences' 1 + k rows come after the others, which are laid
out as in a step without drafts); row by row from the sequences otherwise (few rows). This is the
one place that chooses; either way the rows' facts come from the input batch in one gather, and
the step is read the same way.
"""

from __future__ import annotations

import numpy as np
import torch

from model.kv_cache import KVCache
from model.transfer import to_device
from service.engine.beams import beam_groups
from service.engine.input_batch import InputBatch
from service.engine.requests import Sequence, StepPlan
from service.engine.step_data import StepRows

# From this many running requests a step is laid out from the input batch's arrays: below it
# numpy's fixed cost per operation (a few µs, some dozen of them) exceeds Python's per row. Either
# way its rows' facts are gathered from the input batch, and its tokens read as a batch
# (service/engine/step_reader.py).
BATCHED_ROWS = 16


class StepLayout:
    def __init__(self, batch: InputBatch, cache: KVCache, speculative: bool) -> None:
        """`speculative`: sequences may verify drafts."""
        self.batch = batch
        self.cache = cache
        self.device = cache.device
        self.speculative = speculative

    def layout(self, plan: StepPlan) -> StepRows:
        """Where every sequence's logits will be, and the index vectors on the device."""
        # The decoding sequences' rows first, in slot order (1 + k for one with a draft), then one
        # row per prompt chunk (a completed prompt's sequences share it; a chunk that leaves part
        # of its prompt for later samples nothing); the sampled rows in the same order. Once the
        # running sequences are packed into slots 0..D-1 and no prompt completes this step, or
        # those that do took the next free slots, sampled row b is logits row b and slot b for
        # every b: the read path without gathers. (A prompt admitted into a slot a finished
        # sequence left inside the batch, the usual case under heavy churn, still gathers.)
        # A grammar's rows, a beam's (whose search chooses its token from the step's candidates:
        # service/engine/beams.py) draw like any other; a draft's 1 + k rows follow the other
        # decoding rows (`_batch`).
        rows = self._each(plan) if plan.running < BATCHED_ROWS else self._batch(plan)
        if plan.beams:  # drawn like any row, their draws unused: their searches' candidates instead
            rows.beams = beam_groups(rows.sampled, rows.facts.own)
        return rows

    def _batch(self, plan: StepPlan) -> StepRows:
        """Every row draws one token from the sampler: who holds each slot and its length come from
        the input batch, and the decode feeds the sampler's last tokens. The sequences verifying a
        draft (`plan.drafted`) come after the others, 1 + k rows each: the others' rows are those
        of a step without drafts, less theirs, and cost nothing more."""
        batch = self.batch
        drafted = plan.drafted if self.speculative else []
        # plan.decode's sequences' slots, those verifying a draft left for `_batch_drafted`
        slots = batch.decoding(self.cache.in_use, plan.sitting_out + [seq.slot for seq in drafted])
        decoding = list(map(batch.seq.__getitem__, slots))
        sampled = list(zip(map(batch.state.__getitem__, slots), decoding))
        row_of = dict(zip(slots, range(len(slots))))
        rows = len(slots)
        if drafted:
            return self._batch_drafted(plan, drafted, slots, decoding, sampled, row_of)
        for index, chunk in enumerate(plan.prefill):
            if chunk.completes:
                row_of.update((seq.slot, rows + index) for seq in chunk.state.sequences)
        completing = [(state, seq) for state in plan.completing for seq in state.live]
        if completing:
            sampled += completing
            slots = slots + [seq.slot for _, seq in completing]
        logit_rows = list(range(rows)) + [row_of[seq.slot] for _, seq in completing]
        host = np.empty((3, len(slots)), dtype=np.int64)  # one host→device copy: [3, B]
        host[0], host[1], host[2] = logit_rows, slots, batch.lengths(slots)
        return self._rows(decoding, row_of, sampled, host, slots, logit_rows, drafted=[], from_device=True)

    def _batch_drafted(self, plan: StepPlan, drafted: list[Sequence], slots: list[int], decoding: list[Sequence],
                       sampled: list, row_of: dict[int, int]) -> StepRows:
        """`_batch`'s layout with the sequences verifying a draft: the undrafted decoding rows
        (`slots`, ...) first, then each drafted sequence's 1 + k rows (row j draws the token at
        its length + j: its seed's draw there), then the completing prompts'."""
        batch, first = self.batch, len(slots)
        counts = [1 + len(seq.draft) for seq in drafted]
        drafted_slots = [seq.slot for seq in drafted]
        row = first
        for slot, count in zip(drafted_slots, counts):
            row_of[slot] = row
            row += count
        for index, chunk in enumerate(plan.prefill):
            if chunk.completes:
                row_of.update((seq.slot, row + index) for seq in chunk.state.sequences)
        sampled += [(batch.state[seq.slot], seq) for seq, count in zip(drafted, counts) for _ in range(count)]
        completing = [(state, seq) for state in plan.completing for seq in state.live]
        sampled += completing
        verified = row - first
        offsets = np.arange(verified) - np.repeat(np.cumsum(counts) - counts, counts)  # [D]: j of each row
        tail = [seq.slot for _, seq in completing]
        all_slots = slots + [slot for slot, count in zip(drafted_slots, counts) for _ in range(count)] + tail
        host = np.empty((3, len(all_slots)), dtype=np.int64)  # one host→device copy: [3, B]
        host[0, :row] = np.arange(row)
        host[0, row:] = [row_of[slot] for slot in tail]
        host[1] = all_slots
        host[2] = batch.lengths(host[1])  # the undrafted and completing rows' counters (drafted: below)
        host[2, first:row] = np.repeat([len(seq.token_ids) + seq.pending for seq in drafted], counts) + offsets
        step_rows = self._rows(decoding + drafted, row_of, sampled, host, all_slots, host[0].tolist(), drafted,
                               from_device=True)
        step_rows.undrafted = np.concatenate([np.arange(first), np.arange(row, len(all_slots))])
        return step_rows

    def _rows(self, decoding: list[Sequence], row_of: dict[int, int], sampled: list, host: np.ndarray, slots: list[int],
              logit_rows: list[int], drafted: list[Sequence], from_device: bool) -> StepRows:
        """`host`: [3, B] the sampled rows' logits rows, slots and counters. Their facts are gathered
        from the input batch, which counts their draws."""
        device = to_device(torch.from_numpy(host), self.device)  # [3, B]: one copy
        sample_rows, sample_slots, sample_counters = device  # [B] each
        ordered = list(range(len(slots)))
        logits_in_order = logit_rows == ordered  # slots aside: those a host-paced row sat out leave holes
        in_order = logits_in_order and slots == ordered
        facts = self.batch.gather(slots, host, device, in_order, repeated=bool(drafted))
        read = slice(0, len(slots)) if in_order else sample_slots
        rows = StepRows(decoding, row_of, sampled, sample_rows, sample_slots, sample_counters, facts, in_order, drafted,
                        from_device, read)
        rows.logits_in_order = logits_in_order
        return rows

    def _each(self, plan: StepPlan) -> StepRows:
        """The layout row by row, from the sequences themselves."""
        # Slots are unique. (A comprehension, not state.live: this runs over every row of every step.)
        by_slot = sorted([(seq.slot, state, seq) for state in plan.decode for seq in state.sequences
                          if seq.finish_reason is None])
        decoding = [seq for _, _, seq in by_slot]
        sampled = [(state, seq) for _, state, seq in by_slot]
        drafted = [seq for seq in decoding if seq.draft] if self.speculative else []
        if not drafted:
            # Comprehensions, not a loop of appends: this runs over every row of every step.
            row_of = dict(zip([seq.slot for seq in decoding], range(len(decoding))))
            row = len(decoding)
        else:
            row_of, row = {}, 0
            for seq in decoding:
                row_of[seq.slot] = row
                row += 1 + len(seq.draft)
            # Row j of a sequence's 1 + k draws the token at its length + j (its seed's draw there).
            sampled = [(state, seq) for state, seq in sampled for _ in range(1 + len(seq.draft))]
        for index, chunk in enumerate(plan.prefill):
            if chunk.completes:
                row_of.update((seq.slot, row + index) for seq in chunk.state.sequences)
        sampled += [(state, seq) for state in plan.completing for seq in state.live]
        if not drafted:
            slots = [seq.slot for _, seq in sampled]
            logit_rows = [row_of[slot] for slot in slots]
            counters = [len(seq.token_ids) + seq.pending for _, seq in sampled]
        else:
            logit_rows, slots, counters, undrafted, previous, j = [], [], [], [], None, 0
            for row, (_, seq) in enumerate(sampled):
                j = j + 1 if seq is previous else 0
                previous = seq
                logit_rows.append(row_of[seq.slot] + j)
                slots.append(seq.slot)
                counters.append(len(seq.token_ids) + seq.pending + j)
                if not seq.draft:
                    undrafted.append(row)
        host = np.array([logit_rows, slots, counters], dtype=np.int64).reshape(3, len(slots))
        # With no host-paced row or draft the decode rows are the first sampled ones, each feeding
        # the token the sampler left on the device for its slot.
        from_device = not (plan.host_paced or drafted)
        rows = self._rows(decoding, row_of, sampled, host, slots, logit_rows, drafted, from_device)
        if drafted:
            rows.undrafted = undrafted
        return rows
