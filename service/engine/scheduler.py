"""Which sequences run each step: the waiting queue, admission into KV-cache slots, cancellation.

Thread model: `submit` and `cancel` may be called from another thread than the one stepping
(tests drive both from one) and only touch the waiting queue and the cancel set, under a lock.
Everything else (running requests, slots) belongs to the caller of `schedule`, once per step.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from model.kv_cache import KVCache
from service.engine.types import (
    EngineStopped,
    FinishReason,
    GenerationRequest,
    PromptScores,
    QueueFull,
    SamplingParams,
)


def slots_needed(params: SamplingParams) -> int:
    """KV-cache slots a request holds while it runs: one per beam or returned sequence."""
    return max(params.num_beams, params.num_return_sequences)


def validate_request(request: GenerationRequest, max_len: int, max_slots: int) -> None:
    """Refuse what can never run, saying why (the HTTP side turns this into a 422).

    The HTTP side calls it before sending a request to the core, and the core again on receipt.
    """
    p, prompt_length = request.params, len(request.prompt_ids)
    if prompt_length == 0:
        raise ValueError("the prompt is empty: at least one token is needed")
    if p.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {p.max_new_tokens}")
    if prompt_length + p.max_new_tokens > max_len:
        raise ValueError(
            f"prompt ({prompt_length} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds "
            f"the maximum sequence length {max_len}"
        )
    if p.num_beams < 1 or p.num_return_sequences < 1:
        raise ValueError("num_beams and num_return_sequences must be at least 1")
    if p.num_beams > 1 and p.do_sample:
        raise ValueError("beam search with sampling is not supported: set do_sample=false")
    if p.num_beams > 1 and p.num_return_sequences > p.num_beams:
        raise ValueError(
            f"num_return_sequences ({p.num_return_sequences}) must not exceed num_beams ({p.num_beams})"
        )
    if p.num_beams == 1 and p.num_return_sequences > 1 and not p.do_sample:
        raise ValueError("several return sequences need do_sample=true or num_beams > 1")
    if p.do_sample and p.temperature <= 0:
        raise ValueError(f"temperature must be positive when sampling, got {p.temperature}")
    if not 0 < p.top_p <= 1 or p.top_k < 0 or p.repetition_penalty <= 0:
        raise ValueError("top_p must be in (0, 1], top_k >= 0, repetition_penalty > 0")
    if any(not s for s in p.stop):
        raise ValueError("stop strings must not be empty")
    if p.num_beams > 1 and p.stop:
        raise ValueError("stop strings are not supported with beam search")
    if not math.isfinite(p.length_penalty) or p.early_stopping not in (True, False, "never"):
        raise ValueError("length_penalty must be finite; early_stopping true, false or 'never'")
    if slots_needed(p) > max_slots:
        raise ValueError(
            f"the request needs {slots_needed(p)} sequences at once; the engine has "
            f"{max_slots} slots"
        )


@dataclass
class Sequence:
    """One generated continuation, owning one KV-cache slot while it runs."""

    index: int  # sequence_index within its request
    slot: int
    token_ids: list[int]  # prompt + generated; the cache holds all but the last
    prompt_length: int
    finish_reason: FinishReason | None = None

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

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def slots_needed(self) -> int:
        return slots_needed(self.params)

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.sequences if s.finish_reason is None]

    @property
    def done(self) -> bool:
        return bool(self.sequences) and not self.live


@dataclass
class StepPlan:
    prefill: list[RequestState]  # admitted this step: their prompts run now
    decode: list[RequestState]  # already running: one token per live sequence
    cancelled: list[RequestState]  # leave now; their slots (if any) are already free
    moves: list[tuple[int, int, int]]  # (from slot, to slot, cached length): packing copies


class Scheduler:
    """`start(state, slots)` builds an admitted request's sequences on the slots it was given."""

    def __init__(
        self,
        cache: KVCache,
        max_waiting: int,
        max_prefill_tokens: int,
        start: Callable[[RequestState, list[int]], list[Sequence]],
    ) -> None:
        self.cache = cache
        self._start = start
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.running: list[RequestState] = []
        self._lock = threading.Lock()
        self._waiting: deque[list[RequestState]] = deque()  # submissions, admitted whole
        self._waiting_count = 0
        self._cancel: set[str] = set()
        self._active_ids: set[str] = set()  # submitted and not yet finished
        self._closed = False

    # --- submission side ----------------------------------------------------------------------------
    def submit(self, requests: list[GenerationRequest]) -> list[RequestState]:
        """Queue requests to be admitted together (several prompts of one HTTP call)."""
        for request in requests:
            validate_request(request, self.cache.max_len, self.cache.max_slots)
        ids = [r.request_id for r in requests]
        states = [RequestState(request) for request in requests]
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
    def schedule(self, now: float) -> StepPlan:
        with self._lock:
            cancel, self._cancel = self._cancel, set()
            cancelled = self._drop_waiting(cancel)
            admitted = self._pop_admissible()
        decode = []
        for state in self.running:
            if state.request.request_id in cancel:
                self._release_cancelled(state)
                cancelled.append(state)
            else:
                decode.append(state)
        # Running before they start, so a failure while starting one still frees the others.
        self.running = decode + admitted
        for state in admitted:
            state.scheduled_time = now
            slots = self.cache.allocate(state.slots_needed)
            try:
                state.sequences = self._start(state, slots)
            except Exception:
                self.cache.free(slots)
                raise
        return StepPlan(admitted, decode, cancelled, self._pack())

    def _release_cancelled(self, state: RequestState) -> None:
        for seq in state.live:
            self.release_sequence(seq, "cancelled")

    def release_sequence(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        self.cache.free(seq.slot)

    def drop_finished(self) -> None:
        self.running = [s for s in self.running if not s.done]

    def abort_running(self) -> list[RequestState]:
        """Free every running request's slots (after a failed step) and forget them."""
        aborted, self.running = self.running, []
        for state in aborted:
            self._release_cancelled(state)
            self.forget(state.request.request_id)
        return aborted

    def _drop_waiting(self, cancel: set[str]) -> list[RequestState]:
        dropped = []
        for submission in self._waiting:
            for state in [s for s in submission if s.request.request_id in cancel]:
                submission.remove(state)
                dropped.append(state)
        self._waiting = deque(s for s in self._waiting if s)
        self._waiting_count -= len(dropped)
        return dropped

    def _pop_admissible(self) -> list[RequestState]:
        """Whole submissions in arrival order while slots and the prefill budget allow.

        A submission that needs more slots than the cache has is admitted in parts.
        """
        admitted: list[RequestState] = []
        slots_free, longest = self.cache.slots_free, 0
        while self._waiting:
            submission = list(self._waiting[0])
            if sum(s.slots_needed for s in submission) > self.cache.max_slots:
                submission = self._fitting_prefix(submission, slots_free)
            slots = sum(s.slots_needed for s in submission)
            longest_if = max([longest] + [len(s.request.prompt_ids) for s in submission])
            # Prefill pads every prompt to the longest, so its cost is rows × longest.
            cost = (len(admitted) + len(submission)) * longest_if
            if not submission or slots > slots_free or (admitted and cost > self.max_prefill_tokens):
                break
            del self._waiting[0][: len(submission)]
            if not self._waiting[0]:
                self._waiting.popleft()
            self._waiting_count -= len(submission)
            admitted.extend(submission)
            slots_free, longest = slots_free - slots, longest_if
        return admitted

    @staticmethod
    def _fitting_prefix(submission: list[RequestState], slots_free: int) -> list[RequestState]:
        taken = 0
        for count, state in enumerate(submission):
            taken += state.slots_needed
            if taken > slots_free:
                return submission[:count]
        return submission

    def _pack(self) -> list[tuple[int, int, int]]:
        """Move sequences from the highest slots into holes below, so the batch stays one span.

        Each move copies one sequence's cache once; a batch with holes would instead gather
        (copy) every row's keys and values in every layer of every step.
        """
        moves = []
        live = sorted((seq for state in self.running for seq in state.live), key=lambda s: s.slot)
        while live and live[-1].slot >= len(live):
            seq = live.pop()
            target = self.cache.allocate(1)[0]  # the lowest free slot, below seq.slot
            self.cache.free(seq.slot)
            # Freshly admitted sequences have nothing cached yet; prefill writes their new slot.
            cached = len(seq.token_ids) - 1 if len(seq.token_ids) > seq.prompt_length else 0
            moves.append((seq.slot, target, cached))
            seq.slot = target
            live.insert(0, seq)
            live.sort(key=lambda s: s.slot)
        return moves
