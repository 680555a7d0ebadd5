"""Which sequences run each step, and what becomes of them: admission from the waiting queue
(admission.py: into KV-cache slots, sharing cached prefix blocks), prompt chunks within the step's
prefill budget, cancellation, preemption, packing (`schedule`: one StepPlan down to the model
runner), then the step's tokens appended, stops checked and requests finished or failed
(`update_from_output`: the launched step read, one StepResults up). The running requests are
running.py's. Nothing here runs the model.

Thread model: `submit` and `cancel` may be called from another thread than the one stepping
(tests drive both from one) and only touch the waiting queue (service/engine/waiting.py, under its
lock). Everything else (running requests, slots) belongs to the caller of `schedule`, once per step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from operator import attrgetter

import numpy as np

from model.kv_cache import KVCache
from model.lora import BASE
from service.engine.admission import Admission, PrefillBudget
from service.engine.beams import BeamMove, advance_beam_requests, beam_results
from service.engine.block_room import BlockRoom, OutOfBlocks, recomputable
from service.engine.faults import RowFault
from service.engine.grammar import Grammars
from service.engine.ngram_drafter import NgramSettings
from service.engine.prefix_cache import PrefixCache
from service.engine.requests import PrefillChunk, RequestState, Sequence, StepPlan
from service.engine.running import RunningRequests
from service.engine.speculation import needing_host_tokens, propose
from service.engine.step_data import LaunchedStep
from service.engine.step_reader import StepReader, StepResults
from service.engine.validation import validate_request
from service.engine.types import FinishReason, GenerationRequest, RequestDone, RequestFailed, RequestStarted
from service.engine.waiting import WaitingQueue

log = logging.getLogger(__name__)


BY_SLOT = attrgetter("slot")


class Scheduler:
    def __init__(
        self,
        cache: KVCache,
        max_waiting: int,
        max_prefill_tokens: int,
        eos_token_id: int,
        prefix_caching: bool = False,
        grammars: Grammars | None = None,
        speculative: NgramSettings | None = None,
    ) -> None:
        """`cache`: its slot allocation (the runner owns its tensors); `grammars`: the grammar
        engine (None: no constrained requests); `speculative`: n-gram drafts' settings, or None."""
        self.cache = cache
        self.eos_token_id = eos_token_id
        self.grammars = grammars
        self.speculative = speculative
        self.reader = StepReader(self, eos_token_id)
        self._beam_moves: list[BeamMove] = []  # what the beam searches read ask of the next plan
        self.waiting = WaitingQueue(max_waiting)
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix = PrefixCache(prefix_caching, cache)
        self.room = BlockRoom(cache)
        self.active = RunningRequests()
        self.admission = Admission(cache, self.waiting, self.prefix, self.room, self.active, grammars, speculative,
                                   eos_token_id)
        self.releases = 0  # sequences ended so far (finished or cancelled)
        self.preemptions = 0  # running requests sent back to the queue for want of KV blocks

    # --- submission side ----------------------------------------------------------------------------
    def submit(self, requests: list[GenerationRequest], adapters: list[int] | None = None) -> list[RequestState]:
        """Queue requests to be admitted in order (several prompts of one HTTP call); `adapters`:
        each one's LoRA adapter index (default: the base model)."""
        for request in requests:
            validate_request(request, self.cache.max_len, self.cache.max_slots)
            self.room.check_fits(request)
        states = [RequestState(request, adapter=index) for request, index in zip(requests, adapters or [BASE] * len(requests))]
        self.waiting.add(states)
        return states

    def cancel(self, request_id: str) -> None:
        """Takes effect at the next step (its slots are free after that step)."""
        self.waiting.cancel(request_id)

    def cancel_all(self) -> None:
        self.waiting.cancel_all()

    def forget(self, request_id: str) -> None:
        """The request has finished: its id may be used again."""
        self.waiting.forget(request_id)

    def close(self) -> None:
        """Refuse new submissions from now on (draining)."""
        self.waiting.close()

    @property
    def running(self) -> list[RequestState]:
        """The running requests, in admission order."""
        return self.active.states

    @property
    def host_paced(self) -> list[RequestState]:
        return self.active.host_paced

    @property
    def beams_running(self) -> int:
        return self.active.beams

    def has_work(self) -> bool:
        return bool(self.active.states) or self.waiting.count > 0 or bool(self.waiting.cancelled)

    # --- stepping side --------------------------------------------------------------------------
    def schedule(self, now: float, exhausted: list[RequestState] | None = None, in_flight: bool = False) -> StepPlan:
        """`in_flight`: a step's tokens are still unread (the core's overlap); `exhausted`: the
        requests whose sequences drew their last token in it (a row more would draw past
        max_new_tokens)."""
        cancelled: list[RequestState] = []
        if self.waiting.cancelled:  # read without the lock: a cancel arriving meanwhile is taken next step
            cancel = self.waiting.take_cancelled()
            cancelled = self.waiting.drop(lambda state: state.request.request_id in cancel)
            leaving = [state for state in self.active.states if state.request.request_id in cancel]
            for state in leaving:
                self._release_cancelled(state)
            self.leave(leaving)
            cancelled += leaving
        kept = self.active.states
        # Prompts already admitted go on first, in admission order; then new ones while slots
        # and the budget allow.
        chunks = []
        # A comprehension over every running request, the rest over the few prefilling or exhausted.
        decode = [state for state in kept if state.prefilled >= state.prompt_length]
        prefilling, waiting = len(decode) < len(kept), self.waiting.count > 0
        budget = PrefillBudget(self.max_prefill_tokens) if prefilling or waiting else None
        if prefilling:
            for state in [state for state in kept if state.prefilled < state.prompt_length]:
                if size := budget.take(state.prompt_length - state.prefilled):
                    chunks.append(PrefillChunk(state, state.prefilled, state.prefilled + size))
        # Those not stepped: the exhausted, and (found among the few host-paced, not by a pass over
        # every row) those sitting out.
        left_out = {id(state) for state in exhausted} if exhausted else set()
        sitting_out, paced = [], []
        if self.active.host_paced:
            paced = [state for state in self.active.host_paced
                     if state.prefilled >= state.prompt_length and id(state) not in left_out]
        if in_flight and paced:
            # Its next step needs its last token on the host (a draft, a beam): a request
            # whose token is in flight sits this step out, and overlap stays on for the others.
            # A drafter that would not draft now decodes as a plain row instead (no draft).
            ready, waiting_for_host = [], []
            for state in paced:
                (waiting_for_host if any(seq.pending for seq in state.live) else ready).append(state)
            alone = not chunks and len(decode) == len(waiting_for_host)  # no other row in this step so far
            sitting_out = needing_host_tokens(waiting_for_host, self.speculative, self.cache.slots_used, alone)
            left_out.update(id(state) for state in sitting_out)
            paced = ready  # the others step without a draft
        if left_out:
            decode = [state for state in decode if id(state) not in left_out]
        # A block for each row whose write this step starts one, a copy of the block it writes where
        # that one is shared: most steps, no row needs either (found with array operations).
        stepping_before = len(decode)
        rows = [(seq.slot, len(seq.token_ids) + seq.pending) for state in decode for seq in state.sequences
                if seq.finish_reason is None]
        if rows:
            cache = self.cache
            slots, written = np.array(rows, dtype=np.int64).T
            block = (written - 1) // cache.block_size  # the block of position written - 1, this step's write
            # (a block not held yet is the scratch block in the table: refs 0)
            growing = (block >= cache.row_blocks[slots]) | (cache.refs[cache.tables[slots, block]] > 1)
            if growing.any():
                decode, chunks, deferred = self._grow(decode, chunks, slots[growing], written[growing])
                if deferred:  # out of blocks, their tokens in flight: preempted next step if still short
                    sitting_out = sitting_out + deferred
        if paced and len(decode) < stepping_before:  # a drafter preempted by _grow drafts nothing
            stepping = {id(state) for state in decode}
            paced = [state for state in paced if id(state) in stepping]
        admitted, unstarted = self.admission.admit(now, budget, chunks) if waiting else ([], [])
        moves = [] if self.cache.packed else self._pack()  # packed: no live sequence above a hole
        for chunk in chunks:  # what the plan's forwards write, before anyone can read it
            state = chunk.state
            first = state.sequences[0]
            self.room.writable(first.slot, chunk.start, chunk.end)  # blocks it shares are copied first
            state.prefilled = first.cached = chunk.end
            self.prefix.register(first, chunk.end)  # others may share its full blocks from the next step
            if chunk.completes and state.beam is None:  # the others share the prompt's blocks
                for seq in state.sequences[1:]:
                    self.cache.fork(first.slot, seq.slot, chunk.end)
                    seq.cached = len(seq.token_ids)
                    seq.block_keys = list(first.block_keys)
        beam_moves, self._beam_moves = self._beam_moves, []
        active = self.active
        plan = StepPlan(chunks, decode, cancelled, moves, [chunk.state for chunk in chunks if chunk.completes],
                        sum(chunk.end - chunk.start for chunk in chunks), sum(s.reused for s in admitted), admitted,
                        running=len(active.states), host_paced=len(active.host_paced), beams=active.beams,
                        sitting_out=[seq.slot for state in sitting_out for seq in state.live], beam_moves=beam_moves,
                        failed=[self._answer_failed(state, fault) for state, fault in unstarted])
        if self.speculative is not None and paced:  # drafters are host-paced
            # The batch a draft token is priced against: every running sequence (held slots: a
            # count, not a pass over the rows), those sitting this step out too (they run the next).
            plan.drafted = propose(paced, self.speculative, self.cache.slots_used + plan.prefill_tokens)
            if plan.drafted:
                self.room.grow_drafts(paced)  # a draft with no room left is cut, perhaps to nothing
                plan.drafted = [seq for seq in plan.drafted if seq.draft]
        return plan

    def refuse_uncompiled(self) -> list[RequestFailed]:
        """Take the grammars compiled since the last step. Waiting requests whose grammar failed to
        compile (the HTTP side checked it, so this is rare) each fail alone, before holding a slot."""
        if self.grammars is None or not self.waiting.count:  # only a waiting request awaits one
            return []
        self.grammars.collect()
        errors = self.grammars.errors
        if not errors:
            return []
        refused = self.refuse_waiting(lambda state: state.params.grammar in errors)
        failed = [RequestFailed(state.request.request_id, errors[state.params.grammar], 422, "validation", "grammar")
                  for state in refused]
        errors.clear()  # every waiting request of those grammars is refused; a later one compiles again
        return failed

    # --- reading a launched step ------------------------------------------------------------------
    def in_flight(self, launched: LaunchedStep) -> None:
        """The launched step's tokens will be read after the next step is launched (overlap): its
        rows count as pending meanwhile (the next step feeds their tokens from the device)."""
        for _, seq in launched.rows.sampled:
            seq.pending += 1

    def update_from_output(self, launched: LaunchedStep, host: np.ndarray, results: StepResults) -> None:
        """Append a launched step's tokens (`host`: its sampler rows) and check their stops; report
        who started, who finished and who failed. Requests cancelled, or finished by an earlier
        step, since it was launched get nothing."""
        if launched.deferred:
            for _, seq in launched.rows.sampled:
                seq.pending -= 1
        results.started += [
            RequestStarted(s.request.request_id, s.scheduled_time - s.request.arrival_time, s.seed, s.prompt_scores)
            for s in launched.completing
            if not s.reported
        ]
        self.reader.read(launched, host, results)
        if launched.beams is not None:
            self._advance_beams(launched)
        # Only requests a sequence of which ended here can be done: no pass over every row.
        if launched.failed:  # before the finished: a failed request is never also done
            results.failed += self._fail(launched.failed)
        finished = [state for state in {id(s): s for s in launched.ended}.values() if state.done and not state.reported]
        if finished:
            results.done += [self.finish(state) for state in finished]
            self.leave(finished)

    def _advance_beams(self, launched: LaunchedStep) -> None:
        """The beam searches' steps from the candidates read with the launched step: the moves
        they ask of the next plan, the searches done, those failed (each alone)."""
        outcome = advance_beam_requests(launched.beams)
        # A beam continuing another's beam on a row of its own takes that beam's blocks, shared,
        # not copied: the next plan's rows read them, and packing moves (made before the runner
        # sees the plan) carry the tables. Only the partial last block, which it writes next, is
        # copied, now, for every beam of the step at once (where the pool is short, each row
        # copies it as it grows instead).
        copies = [(source, slot, move.length) for move in outcome.moves for source, slot in move.copies]
        if copies:
            sources, slots, lengths = map(list, zip(*copies))
            if not self.cache.share_rows(sources, slots, lengths) and not (
                    self.room.make_room(len(copies)) and self.cache.share_rows(sources, slots, lengths)):
                for source, slot, length in copies:
                    self.cache.release(slot)
                    self.cache.fork(source, slot, length)
        self._beam_moves += outcome.moves
        for state in outcome.done:
            for seq in state.sequences:
                self.release_sequence(seq, "length", state)
            launched.ended.append(state)
        for state, fault in outcome.failed:
            self.reader.fail(state, fault, launched)

    def _fail(self, failures: list[tuple[RequestState, RowFault]]) -> list[RequestFailed]:
        """Requests whose own rows failed leave (their sequences already ended) and are answered
        with their fault; every other request of the step went on."""
        answers, leaving = [], []
        for state, fault in {id(state): (state, fault) for state, fault in failures}.values():
            if state.reported:
                continue
            leaving.append(state)
            answers.append(self._answer_failed(state, fault))
        self.leave(leaving)
        return answers

    def _answer_failed(self, state: RequestState, fault: RowFault) -> RequestFailed:
        log.warning("request %s failed alone (%s): %s", state.request.request_id, fault.cause, fault.message)
        state.reported = True
        self.forget(state.request.request_id)
        return RequestFailed(state.request.request_id, fault.message, fault.status, fault.error_type, fault.cause)

    def finish(self, state: RequestState) -> RequestDone:
        """The request's answer is complete (its sequences ended, or it was cancelled)."""
        state.reported = True
        self.forget(state.request.request_id)
        beams = beam_results(state) if state.beam is not None and state.beam.done else None
        return RequestDone(state.request.request_id, beams)

    def _release_cancelled(self, state: RequestState) -> None:
        for seq in state.live:
            self.release_sequence(seq, "cancelled", state)

    def release_sequence(self, seq: Sequence, reason: FinishReason, state: RequestState) -> None:
        """The sequence ends; its blocks stay cached for prompts that share them."""
        seq.finish_reason = reason
        self.releases += 1
        self._keep(seq, state)
        self.cache.free(seq.slot)

    def _keep(self, seq: Sequence, state: RequestState) -> None:
        """Register what a leaving sequence computed (a beam's rows hold other beams' tokens by
        now: only the prompt's blocks, registered as it was prefilled, count), and its scores."""
        if state.beam is None:
            self.prefix.register(seq, seq.cached)
        if state.prompt_scores is not None and seq.index == 0:
            self.prefix.keep_scores(state)

    def end_failed(self, state: RequestState, scrub: bool = False) -> None:
        """A request failed (faults.py): its live sequences leave now, and their slots keep
        nothing for later prompts (what they hold may be what failed). `scrub`: zero them too,
        before anyone can be given them (after non-finite values: a later sequence's masked
        positions still meet them, and 0 * NaN is NaN)."""
        freed = [seq for seq in state.sequences if seq.finish_reason is None]
        for seq in freed:
            seq.finish_reason = "error"
            self.releases += 1
            # Not to be found again, and zeroed as they go back to the pool, before this step's
            # plan can give them to a row (a copy on write into one would otherwise be wiped
            # later); queued after the step in flight on the device, which may still write them.
            self.prefix.forget_blocks(self.cache.blocks_of(seq.slot))
            blocks = self.cache.release(seq.slot)  # those no other row holds
            if scrub:
                self.cache.scrub(blocks)
            self.cache.free(seq.slot)

    def adapter_in_use(self, adapter: int) -> bool:
        """Whether a running or waiting request uses the adapter."""
        return any(state.adapter == adapter for state in self.active.states + self.waiting.states())

    def leave(self, states: list[RequestState]) -> None:
        """Running requests leave (finished or cancelled): what is kept about the running follows."""
        self.active.remove(states)

    def abort_running(self) -> list[RequestState]:
        """Free every running request's slots (after a failed step) and forget them, and
        everything the cache kept: a failed step may have left any slot half-written."""
        aborted = self.active.clear()
        self._beam_moves = []  # for slots no request holds any more
        for state in aborted:
            self._release_cancelled(state)
            self.forget(state.request.request_id)
        self.prefix.clear()
        return aborted

    def refuse_waiting(self, refused: Callable[[RequestState], bool]) -> list[RequestState]:
        """Take the waiting requests `refused` says will never run out of the queue, and forget them."""
        dropped = self.waiting.drop(refused)
        for state in dropped:
            self.forget(state.request.request_id)
        return dropped

    def _grow(self, decode: list[RequestState], chunks: list[PrefillChunk], slots: np.ndarray,
              written: np.ndarray) -> tuple[list, list, list]:
        """Blocks for the decoding rows on `slots` whose write this step (position `written` - 1)
        needs a new block or a copy of a shared one; while the pool has none, the youngest
        running request that can be recomputed goes back to the front of the queue (preemption
        by recompute, vLLM's default), and leaves this step's decode and chunks. With overlap a
        decoding request has a token in flight, which a preemption would lose: the youngest that
        could be recomputed once that token is read sits this step out instead (it needs no
        block then), and is preempted at the next step if the pool is still short. Returns the
        decode, the chunks and those sitting out."""
        deferred: list[RequestState] = []
        while True:
            try:
                self.room.grow(slots, written)
                return decode, chunks, deferred
            except OutOfBlocks:
                leaving = next((state for state in reversed(self.active.states) if recomputable(state)), None)
                if leaving is not None:
                    self._preempt(leaving)
                    chunks = [chunk for chunk in chunks if chunk.state is not leaving]
                else:
                    leaving = next((state for state in reversed(decode) if recomputable(state, once_read=True)), None)
                    if leaving is None:
                        raise
                    deferred.append(leaving)
                decode = [state for state in decode if state is not leaving]
                stepping = slots != leaving.sequences[0].slot  # recomputable: one sequence
                slots, written = slots[stepping], written[stepping]

    def _preempt(self, state: RequestState) -> None:
        """Free a running request's row and blocks and queue it first: readmitted, it prefills
        its prompt and the tokens it generated (all but the last, which its next decode feeds),
        samples nothing there, and decodes on."""
        [seq] = state.sequences
        self._keep(seq, state)  # what its recompute will find
        self.cache.free(seq.slot)
        self.leave([state])
        if len(seq.token_ids) > len(state.request.prompt_ids):
            state.resumed = True
            state.prompt_length = len(seq.token_ids) - 1
        state.prefilled = state.reused = seq.cached = 0
        self.preemptions += 1
        self.waiting.push_front(state)

    def _pack(self) -> list[tuple[int, int, int, bool]]:
        """Move sequences from the highest slots into holes below, so the batch stays one span.

        A move is a block-table move (KVCache.move_row): no key or value is copied.
        """
        moves = []
        live = sorted((seq for state in self.active.states for seq in state.live), key=BY_SLOT)
        while live and live[-1].slot >= len(live):
            seq = live.pop()
            target = self.cache.allocate(1, tokens=0)[0]  # the lowest free slot, below seq.slot
            self.cache.move_row(seq.slot, target)
            self.cache.free(seq.slot)  # holding the free target's blocks: none
            moves.append((seq.slot, target))  # for the input batch: the tables moved here
            seq.slot = target
            live.insert(0, seq)
            live.sort(key=BY_SLOT)
        return moves
