"""Which sequences run each step, and what becomes of them: admission from the waiting queue into
KV-cache slots (sharing cached prefix blocks) with each admitted request's sequences, prompt chunks
within the step's prefill budget, cancellation, preemption, packing (`schedule`: one StepPlan down
to the model runner), then the step's tokens appended, stops checked and requests finished or
failed (`update_from_output`: the launched step read, one StepResults up). Nothing here runs the
model.

Thread model: `submit` and `cancel` may be called from another thread than the one stepping
(tests drive both from one) and only touch the waiting queue (service/engine/waiting.py, under its
lock). Everything else (running requests, slots) belongs to the caller of `schedule`, once per step.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from operator import attrgetter

import numpy as np

from model.kv_cache import KVCache
from model.lora import BASE
from service.engine.beams import BeamMove, advance_beam_requests, beam_results, start_beam_search
from service.engine.block_room import BlockRoom, OutOfBlocks, recomputable
from service.engine.faults import RowFault, start_failed
from service.engine.grammar import Grammars
from service.engine.ngram_drafter import NgramSettings
from service.engine.prefix_cache import PrefixCache, PrefixMatch, common_prefix_length
from service.engine.requests import PrefillChunk, RequestState, Sequence, StepPlan
from service.engine.speculation import needing_host_tokens, new_drafter, propose
from service.engine.step_data import LaunchedStep
from service.engine.step_reader import StepReader, StepResults
from service.engine.validation import validate_request
from service.engine.types import FinishReason, GenerationRequest, RequestDone, RequestFailed, RequestStarted
from service.engine.waiting import WaitingQueue

log = logging.getLogger(__name__)


# A prompt that would share at least this many more tokens with a prompt still being prefilled
# than with anything cached waits for it (a step or a few) rather than computing them again.
SHARED_PREFIX_WORTH_WAITING = 32
BY_SLOT = attrgetter("slot")
# Spreads the seeds of a request's several sampled sequences (2^64 / golden ratio).
SEED_STRIDE = 0x9E3779B97F4A7C15
SEED_MODULUS = 2**63  # seeds are int64 tensors on the device


class PrefillBudget:
    """Prompt tokens one step may prefill. Rows are packed (service/engine/forward.py), so each
    costs its own tokens: a short prompt rides beside a long one's chunk.

    A prompt's chunks are whole budgets (the last one what is left of it), never the remainder
    of a budget other prompts used: where its chunks end changes its attention's query counts,
    hence the last bits of its logits (docs/batch-invariance.md), and they must not depend on
    what else arrived. A chunk that does not fit waits for the next step."""

    def __init__(self, tokens: int) -> None:
        self.tokens = self.left = tokens

    def take(self, remaining: int) -> int:
        """The chunk a prompt with `remaining` tokens to go gets this step (0: none fits)."""
        chunk = min(remaining, self.tokens)
        if chunk > self.left:
            return 0
        self.left -= chunk
        return chunk


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
        # Kept up to date as requests come and go (_place, leave), so that neither a step nor an
        # admission asks every running request: the running requests in admission order, those
        # among them that need the host's tokens before each step (RequestState.host_paced), and
        # them by their prompt's first token (only those can share a prefix with a new prompt).
        self.running: list[RequestState] = []
        self.host_paced: list[RequestState] = []
        self.beams_running = 0  # of which beam searches
        self._by_first_token: dict[int, list[RequestState]] = {}
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

    def has_work(self) -> bool:
        return bool(self.running) or self.waiting.count > 0 or bool(self.waiting.cancelled)

    # --- stepping side --------------------------------------------------------------------------
    def schedule(self, now: float, exhausted: list[RequestState] | None = None, in_flight: bool = False) -> StepPlan:
        """`in_flight`: a step's tokens are still unread (the core's overlap); `exhausted`: the
        requests whose sequences drew their last token in it (a row more would draw past
        max_new_tokens)."""
        cancelled: list[RequestState] = []
        if self.waiting.cancelled:  # read without the lock: a cancel arriving meanwhile is taken next step
            cancel = self.waiting.take_cancelled()
            cancelled = self.waiting.drop(lambda state: state.request.request_id in cancel)
            leaving = [state for state in self.running if state.request.request_id in cancel]
            for state in leaving:
                self._release_cancelled(state)
            self.leave(leaving)
            cancelled += leaving
        kept = self.running
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
        if self.host_paced:
            paced = [state for state in self.host_paced
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
        admitted, unstarted = self._admit(now, budget, chunks) if waiting else ([], [])
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
        plan = StepPlan(chunks, decode, cancelled, moves, [chunk.state for chunk in chunks if chunk.completes],
                        sum(chunk.end - chunk.start for chunk in chunks), sum(s.reused for s in admitted), admitted,
                        running=len(self.running), host_paced=len(self.host_paced), beams=self.beams_running,
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

    def _admit(
        self, now: float, budget: PrefillBudget, chunks: list[PrefillChunk]
    ) -> tuple[list[RequestState], list[tuple[RequestState, RowFault]]]:
        """Admit waiting requests in arrival order while slots and the prefill budget allow: those
        started, and those that failed to (each alone: nothing of it is left running).

        One whose prompt shares a long prefix with a prompt still being prefilled waits for it
        (the requests behind it go on), so the shared part is computed once.
        """
        unstarted = []
        with self.waiting.admitting() as (waiting, admitted):
            for state in waiting:
                if state.slots_needed > self.cache.slots_free:
                    break  # first come, first served: nobody overtakes another for slots
                if not self._grammar_ready(state):  # compiling off the step loop: the others go on
                    continue
                match = None
                if self.prefix.enabled:  # without the cache, nothing is reused or worth waiting for
                    match = self._match(state)
                    if not state.resumed and self._worth_waiting(state, match.length if match else 0):
                        continue
                reused = match.length if match else 0
                if not self.room.admits(state, match, len(self.running)):
                    break  # nor for blocks
                # (A preempted sequence whose every block was found has nothing to prefill.)
                remaining = state.prompt_length - reused
                size = budget.take(remaining) if remaining else 0
                if remaining and not size:
                    break
                admitted.append(state)  # out of the queue, started or not
                try:
                    self._place(state, match, now)
                except Exception as exc:
                    log.exception("request %s could not start", state.request.request_id)
                    unstarted.append((state, start_failed(exc)))
                    continue
                if size:
                    chunks.append(PrefillChunk(state, reused, reused + size))
        if unstarted:
            failed = {id(state) for state, _ in unstarted}
            admitted = [state for state in admitted if id(state) not in failed]
        return admitted, unstarted

    def _match(self, state: RequestState) -> PrefixMatch | None:
        """The cached blocks an admission shares: of its prompt, or of a preempted sequence's
        tokens to recompute."""
        tokens = state.sequences[0].token_ids[: state.prompt_length] if state.resumed else state.request.prompt_ids
        alternatives = state.score_alternatives
        if alternatives is not None:  # scores the running prompts sharing its first token computed since
            for other in self._by_first_token.get(tokens[0], ()):
                self.prefix.keep_scores(other)
        return self.prefix.match(tokens, alternatives, state.adapter, samples=not state.resumed)

    def _worth_waiting(self, state: RequestState, reused: int) -> bool:
        prompt, wanted = state.request.prompt_ids, state.score_alternatives
        for other in self._by_first_token.get(prompt[0], ()):  # nothing shared with the others
            if other.prefilled >= len(other.request.prompt_ids):
                continue  # not prefilling
            if other.adapter != state.adapter:
                continue  # another adapter's keys
            if wanted is not None and (not other.params.prompt_logprobs or other.params.top_logprobs < wanted):
                continue  # its scores could not be reused anyway
            shared = min(common_prefix_length(prompt, other.request.prompt_ids), len(prompt) - 1)
            shared -= shared % self.cache.block_size  # whole blocks are shared
            if shared - reused >= SHARED_PREFIX_WORTH_WAITING:
                return True
        return False

    def _place(self, state: RequestState, match: PrefixMatch | None, now: float) -> None:
        """Give an admitted request its slots, the first one starting with the cached blocks it
        shares. If that raises, the slots and blocks are given back and it is not running."""
        state.scheduled_time = now
        slots = self.cache.allocate(state.slots_needed, tokens=0)
        try:
            self.room.place(state, slots, match)  # blocks for the prompt
            if state.resumed:  # preempted: its sequence goes on, on a new row
                state.sequences[0].slot = slots[0]
            else:
                state.sequences = self._new_sequences(state, slots)
        except Exception:
            self.cache.free(slots)
            raise
        self.running.append(state)
        if state.host_paced:
            self.host_paced.append(state)
        self.beams_running += state.beam is not None
        self._by_first_token.setdefault(state.request.prompt_ids[0], []).append(state)
        first = state.sequences[0]
        first.block_keys = list(match.keys) if match is not None else []
        if match is None:
            return
        state.prefilled = state.reused = first.cached = match.length
        state.prompt_scores = match.scores

    def _new_sequences(self, state: RequestState, slots: list[int]) -> list[Sequence]:
        """An admitted request's sequences on its slots: seeds, beam search, drafter, grammar."""
        params, prompt = state.params, state.request.prompt_ids
        if params.do_sample:
            state.seed = params.seed if params.seed is not None else secrets.randbits(63)
        if params.num_beams > 1:
            state.beam = start_beam_search(params, prompt, self.eos_token_id)
        sequences = []
        for index, slot in enumerate(slots):
            seed = (state.seed + index * SEED_STRIDE) % SEED_MODULUS if params.do_sample and state.beam is None else 0
            # A copy of the grammar compiled off the step loop before admission (Grammars.prepare).
            matcher = self.grammars.matcher(params.grammar) if params.grammar is not None else None
            sequences.append(Sequence(index, slot, list(prompt), len(prompt), drafter=new_drafter(self.speculative, params),
                                      matcher=matcher, adapter=state.adapter, seed=seed))
        # A grammar's matcher needs its last token only to draw (StepSampler.launch waits for it),
        # not to plan the step: a constrained request is not host-paced.
        state.host_paced = state.beam is not None or any(s.drafter is not None for s in sequences)
        return sequences

    def _grammar_ready(self, state: RequestState) -> bool:
        grammar = state.params.grammar
        if grammar is None:
            return True
        if not self.grammars.ready(grammar) or grammar in self.grammars.errors:
            return False
        if not self.grammars.cached(grammar):
            # Dropped from the cache since it compiled (more grammars came after it than the cache
            # holds): compiled again on the worker, not by its matcher here on the step loop.
            self.grammars.prepare(grammar)
            return False
        return True

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
        return any(state.adapter == adapter for state in self.running + self.waiting.states())

    def leave(self, states: list[RequestState]) -> None:
        """Running requests leave (finished or cancelled): what is kept about the running follows."""
        if not states:
            return
        gone = {id(state) for state in states}
        self.running = [s for s in self.running if id(s) not in gone]
        if self.host_paced:
            self.host_paced = [s for s in self.host_paced if id(s) not in gone]
        self.beams_running -= sum(state.beam is not None for state in states)
        for first_token in {state.request.prompt_ids[0] for state in states}:
            kept = [s for s in self._by_first_token.get(first_token, ()) if id(s) not in gone]
            if kept:
                self._by_first_token[first_token] = kept
            else:
                self._by_first_token.pop(first_token, None)

    def abort_running(self) -> list[RequestState]:
        """Free every running request's slots (after a failed step) and forget them, and
        everything the cache kept: a failed step may have left any slot half-written."""
        aborted, self.running = self.running, []
        self.host_paced, self.beams_running = [], 0
        self._beam_moves = []  # for slots no request holds any more
        self._by_first_token.clear()
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
                leaving = next((state for state in reversed(self.running) if recomputable(state)), None)
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
        live = sorted((seq for state in self.running for seq in state.live), key=BY_SLOT)
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
