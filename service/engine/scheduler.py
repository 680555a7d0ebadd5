"""Which sequences run each step: the waiting queue, admission into KV-cache slots (reusing
cached prefixes), prompt chunks within the step's prefill budget, cancellation, packing.

Thread model: `submit` and `cancel` may be called from another thread than the one stepping
(tests drive both from one) and only touch the waiting queue and the cancel set, under a lock.
Everything else (running requests, slots) belongs to the caller of `schedule`, once per step.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from model.kv_cache import KVCache
from model.lora import BASE
from service.engine.draft_policy import DraftAcceptance
from service.engine.ngram_drafter import NgramIndex
from service.engine.prefix_cache import PrefixCache, PrefixMatch, ScoredPrefix, common_prefix_length
from service.engine.validation import slots_needed, validate_request
from service.engine.types import (
    EngineStopped,
    FinishReason,
    GenerationRequest,
    PromptScores,
    QueueFull,
    SamplingParams,
)


# A prompt sharing at least this many more tokens with a prompt still being prefilled than
# with anything cached waits for it (a step or a few) rather than computing them again.
SHARED_PREFIX_WORTH_WAITING = 32
BY_SLOT = attrgetter("slot")


@dataclass
class Sequence:
    """One generated continuation, owning one KV-cache slot while it runs."""

    index: int  # sequence_index within its request
    slot: int
    token_ids: list[int]  # prompt + generated
    prompt_length: int
    finish_reason: FinishReason | None = None
    # Leading token_ids whose keys and values the slot holds, written by completed forwards:
    # what the prefix cache may keep when the sequence leaves. All but the last once decoding.
    cached: int = 0
    drafter: NgramIndex | None = None  # speculative decoding's n-gram index of token_ids
    draft: list[int] = field(default_factory=list)  # this step's drafted tokens
    acceptance: DraftAcceptance = field(default_factory=DraftAcceptance)  # how its drafts fared
    matcher: object | None = None  # its grammar's llguidance.LLMatcher, when constrained
    adapter: int = BASE  # its LoRA adapter's index in the model's LoraSet (BASE: none)
    # Tokens sampled on the device that the host has not read yet (the core's overlap: step
    # n + 1 is launched before step n's tokens are read). Its slot holds keys and values for
    # `cached + pending` positions; its next token is drawn at `len(token_ids) + pending`.
    pending: int = 0

    @property
    def written(self) -> int:
        """Positions its slot holds (or will once the queued forwards have run)."""
        return self.cached + self.pending

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.prompt_length :]


@dataclass
class RequestState:
    """A request from submission to its FinishedRequest."""

    request: GenerationRequest
    sequences: list[Sequence] = field(default_factory=list)  # filled at admission
    seed: int | None = None
    beam: object | None = None  # model.beam.BeamSearch for num_beams > 1
    scheduled_time: float | None = None
    first_token_time: float | None = None
    prompt_scores: PromptScores | None = None
    # Prompt tokens in the first sequence's slot: reused from the prefix cache at admission, then
    # grown chunk by chunk; the request decodes once it reaches the prompt's length.
    prefilled: int = 0
    reused: int = 0  # of which taken from the prefix cache
    # Each step needs the host's view of its last tokens (beams, drafts, a grammar's matcher):
    # the core does not run ahead of it (service/engine/core.py, overlap).
    host_paced: bool = False
    reported: bool = False  # its RequestDone was sent: nothing more is said about it
    adapter: int = BASE  # its LoRA adapter's index (set at submission, from the request's name)

    def __post_init__(self) -> None:
        self.prompt_length = len(self.request.prompt_ids)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def slots_needed(self) -> int:
        return slots_needed(self.params)

    @property
    def live(self) -> list[Sequence]:
        sequences = self.sequences
        if len(sequences) == 1:  # most requests, read several times per row per step: no new list
            return sequences if sequences[0].finish_reason is None else []
        return [s for s in sequences if s.finish_reason is None]

    @property
    def done(self) -> bool:
        return bool(self.sequences) and all(s.finish_reason is not None for s in self.sequences)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prompt_length

    @property
    def scored_prefix(self) -> ScoredPrefix | None:
        """The prompt scores computed so far, for a later prompt reusing this one's prefix."""
        if self.prompt_scores is None:
            return None
        return ScoredPrefix(self.prompt_scores, self.params.top_logprobs)

    @property
    def score_alternatives(self) -> int | None:
        """None when the request does not score its prompt, else the alternatives it wants."""
        return self.params.top_logprobs if self.params.prompt_logprobs else None


@dataclass
class PrefillChunk:
    """Prompt tokens [start, end) of one request, run this step into its first slot."""

    state: RequestState
    start: int
    end: int

    @property
    def completes(self) -> bool:
        return self.end == len(self.state.request.prompt_ids)


@dataclass
class StepPlan:
    prefill: list[PrefillChunk]  # prompt chunks run this step; the last one of a prompt samples
    decode: list[RequestState]  # prefilled and running: one token per live sequence
    cancelled: list[RequestState]  # leave now; their slots (if any) are already free
    # Done in this order before the forwards: (from slot, to slot, length, swap) packing moves,
    # then (from slot, to slot, length) prefix copies from running sequences.
    moves: list[tuple[int, int, int, bool]]
    copies: list[tuple[int, int, int]]
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache by this step's admissions

    @property
    def completing(self) -> list[RequestState]:
        return [chunk.state for chunk in self.prefill if chunk.completes]

    @property
    def prefill_tokens(self) -> int:
        return sum(chunk.end - chunk.start for chunk in self.prefill)


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
    """`start(state, slots)` builds an admitted request's sequences on the slots it was given."""

    def __init__(
        self,
        cache: KVCache,
        max_waiting: int,
        max_prefill_tokens: int,
        start: Callable[[RequestState, list[int]], list[Sequence]],
        prefix_caching: bool = False,
        admissible: Callable[[RequestState], bool] | None = None,
    ) -> None:
        """`admissible(state)`: False keeps a waiting request waiting, the ones behind it going on
        (a grammar still compiling off the step loop)."""
        self.cache = cache
        self._start = start
        self._admissible = admissible
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix = PrefixCache(prefix_caching)
        # Kept up to date as requests come and go (_place, leave), so that neither a step nor an
        # admission asks every running request: the running requests in admission order, those
        # among them that need the host's tokens before each step (RequestState.host_paced), and
        # them by their prompt's first token (only those can share a prefix with a new prompt).
        self.running: list[RequestState] = []
        self.host_paced_running = 0
        self._by_first_token: dict[int, list[RequestState]] = {}
        self._lock = threading.Lock()
        self._waiting: deque[list[RequestState]] = deque()  # submissions, in arrival order
        self._waiting_count = 0
        self._cancel: set[str] = set()
        self._active_ids: set[str] = set()  # submitted and not yet finished
        self._closed = False
        self.releases = 0  # sequences ended so far (finished or cancelled)

    # --- submission side ----------------------------------------------------------------------------
    def submit(self, requests: list[GenerationRequest], adapters: list[int] | None = None) -> list[RequestState]:
        """Queue requests to be admitted in order (several prompts of one HTTP call); `adapters`:
        each one's LoRA adapter index (default: the base model)."""
        for request in requests:
            validate_request(request, self.cache.max_len, self.cache.max_slots)
        ids = [r.request_id for r in requests]
        states = [RequestState(request, adapter=index) for request, index in zip(requests, adapters or [BASE] * len(requests))]
        with self._lock:
            if self._closed:
                raise EngineStopped("the engine is shutting down")
            if len(set(ids)) < len(ids) or self._active_ids.intersection(ids):
                raise ValueError(f"request ids must be unique among active requests: {ids}")
            if self._waiting_count + len(states) > self.max_waiting:
                raise QueueFull(f"{self._waiting_count} requests are already waiting")
            self._waiting.append(states)
            self._waiting_count += len(states)
            self._active_ids.update(ids)
        return states

    def cancel(self, request_id: str) -> None:
        """Takes effect at the next step (its slots are free after that step)."""
        with self._lock:
            if request_id in self._active_ids:
                self._cancel.add(request_id)

    def cancel_all(self) -> None:
        with self._lock:
            self._cancel.update(self._active_ids)

    def forget(self, request_id: str) -> None:
        """The request has finished: its id may be used again."""
        with self._lock:
            self._active_ids.discard(request_id)
            self._cancel.discard(request_id)

    def close(self) -> None:
        """Refuse new submissions from now on (draining)."""
        with self._lock:
            self._closed = True

    @property
    def waiting_count(self) -> int:
        return self._waiting_count

    def has_work(self) -> bool:
        return bool(self.running) or self._waiting_count > 0 or bool(self._cancel)

    # --- stepping side --------------------------------------------------------------------------
    def schedule(self, now: float, exhausted: list[RequestState] | None = None) -> StepPlan:
        """`exhausted`: requests whose sequences drew their last token in a step whose tokens are
        still unread (the core's overlap): a row more would draw past max_new_tokens."""
        with self._lock:
            cancel, self._cancel = self._cancel, set()
            cancelled = self._drop_waiting(lambda state: state.request.request_id in cancel)
        if cancel:
            leaving = [state for state in self.running if state.request.request_id in cancel]
            for state in leaving:
                self._release_cancelled(state)
            self.leave(leaving)
            cancelled += leaving
        kept = self.running
        budget = PrefillBudget(self.max_prefill_tokens)
        # Prompts already admitted go on first, in admission order; then new ones while slots
        # and the budget allow.
        chunks = []
        # A comprehension over every running request, the rest over the few prefilling or exhausted.
        decode = [state for state in kept if state.prefilled >= state.prompt_length]
        if len(decode) < len(kept):
            for state in [state for state in kept if state.prefilled < state.prompt_length]:
                if size := budget.take(state.prompt_length - state.prefilled):
                    chunks.append(PrefillChunk(state, state.prefilled, state.prefilled + size))
        if exhausted:
            done = {id(state) for state in exhausted}
            decode = [state for state in decode if id(state) not in done]
        pending: list[tuple[Sequence, Sequence, int]] = []  # (source, destination, length)
        admitted = self._admit(now, budget, chunks, pending)
        moves = self._pack()
        copies = [(source.slot, target.slot, length) for source, target, length in pending]
        for _, target, length in pending:
            target.cached = length
        return StepPlan(chunks, decode, cancelled, moves, copies, sum(s.reused for s in admitted))

    def _admit(
        self, now: float, budget: PrefillBudget, chunks: list[PrefillChunk], pending: list
    ) -> list[RequestState]:
        """Admit waiting requests in arrival order while slots and the prefill budget allow.

        One whose prompt shares a long prefix with a prompt still being prefilled waits for it
        (the requests behind it go on), so the shared part is computed once.
        """
        admitted: list[RequestState] = []
        with self._lock:
            try:
                for state in [state for submission in self._waiting for state in submission]:
                    if state.slots_needed > self.cache.slots_free:
                        break  # first come, first served: nobody overtakes another for slots
                    if self._admissible is not None and not self._admissible(state):
                        continue
                    prompt = state.request.prompt_ids
                    match = None
                    if self.prefix.enabled:  # without the cache, nothing is reused or worth waiting for
                        adapter = state.adapter
                        match = self.prefix.best_match(prompt, state.score_alternatives,
                                                       self._running_prefixes(prompt[0], adapter), adapter)
                        if self._worth_waiting(state, match.length if match else 0):
                            continue
                    reused = match.length if match else 0
                    size = budget.take(len(prompt) - reused)
                    if not size:
                        break
                    admitted.append(state)
                    self._place(state, match, now, pending)
                    chunks.append(PrefillChunk(state, reused, reused + size))
            finally:  # also when starting one failed: those admitted before it are running
                taken = {id(state) for state in admitted}
                self._waiting = deque(k for s in self._waiting if (k := [x for x in s if id(x) not in taken]))
                self._waiting_count -= len(admitted)
        return admitted

    def _running_prefixes(self, first_token: int, adapter: int) -> list[tuple[Sequence, list[int], int, ScoredPrefix | None]]:
        """Running sequences' cached tokens starting with `first_token`, computed with `adapter`
        (no other can share a prefix)."""
        return [
            (seq, seq.token_ids, seq.cached, state.scored_prefix)
            for state in self._by_first_token.get(first_token, ())
            for seq in state.sequences
            if seq.cached and seq.finish_reason is None and seq.adapter == adapter
        ]

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
            if shared - reused >= SHARED_PREFIX_WORTH_WAITING:
                return True
        return False

    def _place(self, state: RequestState, match: PrefixMatch | None, now: float, pending: list) -> None:
        """Give an admitted request its slots, the first one holding the reused prefix."""
        state.scheduled_time = now
        free = self.cache.free_slots
        if match is not None and match.adopt:
            others = self.prefix.eviction_order([slot for slot in free if slot != match.slot], state.slots_needed - 1)
            slots = [match.slot, *others]
        else:
            slots = self.prefix.eviction_order(free, state.slots_needed)
        for slot in slots:
            self.cache.claim(slot)
            self.prefix.drop(slot)
        # Running before it starts: if starting it fails, the step's failure handling reports it.
        self.running.append(state)
        try:
            state.sequences = self._start(state, slots)
        except Exception:
            self.cache.free(slots)
            raise
        self.host_paced_running += state.host_paced
        self._by_first_token.setdefault(state.request.prompt_ids[0], []).append(state)
        if match is None:
            return
        state.prefilled = state.reused = match.length
        state.prompt_scores = match.scores
        first = state.sequences[0]
        if match.adopt:
            first.cached = match.length
        else:
            pending.append((match.source, first, match.length))

    def _release_cancelled(self, state: RequestState) -> None:
        for seq in state.live:
            self.release_sequence(seq, "cancelled", state)

    def release_sequence(self, seq: Sequence, reason: FinishReason, state: RequestState) -> None:
        """The sequence ends; its slot keeps what it cached for prompts that share it."""
        seq.finish_reason = reason
        self.releases += 1
        self.cache.free(seq.slot)
        self.prefix.keep(seq.slot, seq.token_ids[: seq.cached], state.scored_prefix, seq.adapter)

    def end_failed(self, state: RequestState, scrub: bool = False) -> None:
        """A request failed (faults.py): its live sequences leave now, and their slots keep
        nothing for later prompts (what they hold may be what failed). `scrub`: zero them too,
        before anyone can be given them (after non-finite values: a later sequence's masked
        positions still meet them, and 0 * NaN is NaN)."""
        freed = [seq for seq in state.sequences if seq.finish_reason is None]
        for seq in freed:
            seq.finish_reason = "error"
            self.releases += 1
            self.cache.free(seq.slot)
            self.prefix.drop(seq.slot)
        if scrub and freed:
            self.cache.scrub([seq.slot for seq in freed])

    def adapter_in_use(self, adapter: int) -> bool:
        """Whether a running or waiting request uses the adapter."""
        with self._lock:
            waiting = [state for submission in self._waiting for state in submission]
        return any(state.adapter == adapter for state in self.running + waiting)

    def leave(self, states: list[RequestState]) -> None:
        """Running requests leave (finished or cancelled): what is kept about the running follows."""
        if not states:
            return
        gone = {id(state) for state in states}
        self.running = [s for s in self.running if id(s) not in gone]
        self.host_paced_running -= sum(state.host_paced for state in states)
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
        self.host_paced_running = 0
        self._by_first_token.clear()
        for state in aborted:
            self._release_cancelled(state)
            self.forget(state.request.request_id)
        self.prefix.clear()
        return aborted

    def refuse_waiting(self, refused: Callable[[RequestState], bool]) -> list[RequestState]:
        """Take the waiting requests `refused` says will never run out of the queue, and forget them."""
        with self._lock:
            dropped = self._drop_waiting(refused)
        for state in dropped:
            self.forget(state.request.request_id)
        return dropped

    def _drop_waiting(self, dropping: Callable[[RequestState], bool]) -> list[RequestState]:
        dropped = []
        for submission in self._waiting:
            for state in [s for s in submission if dropping(s)]:
                submission.remove(state)
                dropped.append(state)
        self._waiting = deque(s for s in self._waiting if s)
        self._waiting_count -= len(dropped)
        return dropped

    def _pack(self) -> list[tuple[int, int, int, bool]]:
        """Move sequences from the highest slots into holes below, so the batch stays one span.

        Each move copies one sequence's cache once; a batch with holes would instead gather
        (copy) every row's keys and values in every layer of every step. A hole that holds a
        retained prefix swaps it into the slot the sequence left, so packing evicts nothing.
        """
        if self.cache.packed:  # the slots in use are the live sequences': none above a hole
            return []
        moves = []
        live = sorted((seq for state in self.running for seq in state.live), key=BY_SLOT)
        while live and live[-1].slot >= len(live):
            seq = live.pop()
            target = self.cache.allocate(1)[0]  # the lowest free slot, below seq.slot
            self.cache.free(seq.slot)
            retained = self.prefix.length(target)
            moves.append((seq.slot, target, max(seq.written, retained), retained > 0))
            self.prefix.move(target, seq.slot)
            seq.slot = target
            live.insert(0, seq)
            live.sort(key=BY_SLOT)
        return moves
