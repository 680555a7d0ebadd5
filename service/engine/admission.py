"""Admission: waiting requests into KV-cache slots, in arrival order, while slots, blocks and the
step's prefill budget allow. An admitted request shares the cached blocks of its prompt's prefix
(a preempted one, of the tokens it recomputes), gets its sequences (seeds, beam search, drafter,
grammar matcher) and joins the running requests; its first prompt chunk joins the step's. A
request that cannot start fails alone. The scheduler (scheduler.py) calls `admit` once a step.
"""

from __future__ import annotations

import logging
import secrets

from model.kv_cache import KVCache
from service.engine.beams import start_beam_search
from service.engine.block_room import BlockRoom
from service.engine.faults import RowFault, start_failed
from service.engine.grammar import Grammars
from service.engine.ngram_drafter import NgramSettings
from service.engine.prefix_cache import PrefixCache, PrefixMatch, common_prefix_length
from service.engine.requests import PrefillChunk, RequestState, Sequence
from service.engine.running import RunningRequests
from service.engine.speculation import new_drafter
from service.engine.waiting import WaitingQueue

log = logging.getLogger(__name__)

# A prompt that would share at least this many more tokens with a prompt still being prefilled
# than with anything cached waits for it (a step or a few) rather than computing them again.
SHARED_PREFIX_WORTH_WAITING = 32
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


class Admission:
    def __init__(self, cache: KVCache, waiting: WaitingQueue, prefix: PrefixCache, room: BlockRoom,
                 running: RunningRequests, grammars: Grammars | None, speculative: NgramSettings | None,
                 eos_token_id: int) -> None:
        self.cache, self.waiting, self.prefix, self.room, self.running = cache, waiting, prefix, room, running
        self.grammars, self.speculative, self.eos_token_id = grammars, speculative, eos_token_id

    def admit(
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
                if not self.room.admits(state, match, len(self.running.states)):
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
            for other in self.running.sharing_first_token(tokens[0]):
                self.prefix.keep_scores(other)
        return self.prefix.match(tokens, alternatives, state.adapter, samples=not state.resumed)

    def _worth_waiting(self, state: RequestState, reused: int) -> bool:
        prompt, wanted = state.request.prompt_ids, state.score_alternatives
        for other in self.running.sharing_first_token(prompt[0]):  # nothing shared with the others
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
        self.running.add(state)
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
