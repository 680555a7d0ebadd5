"""The HTTP side of the engine's output: token ids → text, stop strings, finished requests.

The engine core sends token ids and log-probabilities (service/engine/types.py CoreStep); this
module, in the HTTP process, turns them into what clients get: TokenEvents with the text each
token releases (held back at partial UTF-8 characters and partial stop strings) and one
FinishedRequest per request. It is the one owner of finishing a request:

- the core says a sequence ended (EOS, length) with its last token, and a request is done;
- a stop string ends a sequence here: the processor finishes it, and once every sequence of the
  request has ended asks the caller to abort the request in the core (`ProcessedStep.abort`),
  whose later tokens for it are ignored;
- the client left (`abort`): the request finishes now with what it has, as "cancelled".

Plain Python, no asyncio: service/http/client.py runs it on the event loop, service/inprocess.py
beside an in-process core for tests and benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from service.engine.types import (
    CoreStep,
    FinishedRequest,
    FinishedSequence,
    FinishReason,
    GenerationRequest,
    PromptScores,
    RequestFailed,
    TokenEvent,
    TopLogprobs,
)
from service.http.text_stream import TextStream
from weights.tokenizer import GPT2Tokenizer


@dataclass
class SequenceOutput:
    text: TextStream
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None


@dataclass
class RequestOutput:
    request: GenerationRequest
    sequences: list[SequenceOutput]
    seed: int | None = None
    queue_seconds: float | None = None
    first_token_time: float | None = None
    prompt_scores: PromptScores | None = None

    @property
    def all_ended(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


@dataclass
class ProcessedStep:
    events: list[TokenEvent]
    finished: list[FinishedRequest]
    failed: list[RequestFailed]
    abort: list[str]  # requests every sequence of which ended here (stop strings): abort in the core


class OutputProcessor:
    def __init__(self, tokenizer: GPT2Tokenizer, clock: Callable[[], float] = time.monotonic) -> None:
        self.tokenizer = tokenizer
        self.clock = clock
        self._requests: dict[str, RequestOutput] = {}

    def add(self, requests: list[GenerationRequest]) -> None:
        for request in requests:
            params = request.params
            # Beam search streams nothing: its hypotheses arrive whole when it is done.
            count = 0 if params.num_beams > 1 else params.num_return_sequences
            streams = [SequenceOutput(TextStream(self.tokenizer, params.stop)) for _ in range(count)]
            self._requests[request.request_id] = RequestOutput(request, streams)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def process(self, step: CoreStep) -> ProcessedStep:
        now = self.clock()
        out = ProcessedStep([], [], [], [])
        for started in step.started:
            request = self._requests.get(started.request_id)
            if request is not None:
                request.seed = started.seed
                request.queue_seconds = started.queue_seconds
                request.prompt_scores = started.prompt_scores
                if not request.sequences:  # beam search: its first step is this one
                    request.first_token_time = now
        for request_id, index, token, logprob, reason, top in step.tokens:
            request = self._requests.get(request_id)
            if request is None or request.sequences[index].finish_reason is not None:
                continue  # ended here already; the core has not heard yet
            out.events.append(self._add_token(request, index, token, logprob, reason, now, top))
            if request.first_token_time is None:
                request.first_token_time = now
            if reason is None and request.sequences[index].finish_reason is not None and request.all_ended:
                # Ended by stop strings, which only this side sees: the core would run on.
                out.abort.append(request_id)
                out.finished.append(self._finish(request, now))
        for done in step.done:
            request = self._requests.get(done.request_id)
            if request is not None:
                out.finished.append(self._finish(request, now, done.beams))
        for failed in step.failed:
            if self._requests.pop(failed.request_id, None) is not None:
                out.failed.append(failed)
        return out

    def abort(self, request_id: str) -> FinishedRequest | None:
        """The client left: finish the request now with what it has (None if already finished)."""
        request = self._requests.get(request_id)
        return None if request is None else self._finish(request, self.clock())

    def fail_all(self, message: str) -> list[RequestFailed]:
        """The core is gone: every request still here fails."""
        failed = [RequestFailed(request_id, message, cause="core_exit") for request_id in self._requests]
        self._requests.clear()
        return failed

    def _add_token(
        self, request: RequestOutput, index: int, token: int, logprob: float, reason: FinishReason | None,
        now: float, top: TopLogprobs | None = None,
    ) -> TokenEvent:
        seq = request.sequences[index]
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        if top is not None:
            seq.top_logprobs.append(top)
        seq.token_times.append(now)
        text = seq.text.add(token)
        if seq.text.stopped:
            reason = "stop_sequence"
        if reason is not None:
            text += seq.text.finish()
            seq.finish_reason = reason
        return TokenEvent(request.request.request_id, index, token, text, logprob, now, top)

    def _finish(
        self, request: RequestOutput, now: float, beams: list[FinishedSequence] | None = None
    ) -> FinishedRequest:
        del self._requests[request.request.request_id]
        params, arrival = request.request.params, request.request.arrival_time
        if beams is not None:
            sequences = [self._decoded(beam) for beam in beams]
        elif params.num_beams > 1:
            # Cancelled before the search was done: nothing it could return.
            sequences = [FinishedSequence([], "", [], "cancelled") for _ in range(params.num_return_sequences)]
        else:
            sequences = [
                FinishedSequence(s.token_ids, s.text.text, s.logprobs, s.finish_reason or "cancelled", None,
                                 s.token_times, s.top_logprobs if params.top_logprobs else None)
                for s in request.sequences
            ]
        first = request.first_token_time
        return FinishedRequest(
            request_id=request.request.request_id,
            sequences=sequences,
            prompt_tokens=len(request.request.prompt_ids),
            seed=request.seed,
            queue_seconds=request.queue_seconds if request.queue_seconds is not None else now - arrival,
            first_token_seconds=first - arrival if first is not None else None,
            total_seconds=now - arrival,
            prompt_logprobs=request.prompt_scores.logprobs if request.prompt_scores else None,
            prompt_scores=request.prompt_scores,
        )

    def _decoded(self, beam: FinishedSequence) -> FinishedSequence:
        beam.text = self.tokenizer.decode(beam.token_ids, skip_special_tokens=True)
        return beam
