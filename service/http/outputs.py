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

A sequence's text (TextStream) is released piece by piece as tokens arrive; two things make the
text of a token unsafe to show at once:
- a byte-level BPE token can end inside a UTF-8 character (decoding it alone gives U+FFFD), so
  its text waits for the token that completes the character: the tokenizer's incremental
  decoder (`tokenizers.decoders.DecodeStream`, weights/tokenizer.py) does that, one Rust call
  per token;
- the text may be the start of a stop string that the next tokens complete; it is held back
  until it cannot be, so a stop string (even one split across tokens) is never shown in part.

Plain Python, no asyncio: service/http/client.py runs it on the event loop, service/inprocess.py
beside an in-process core for tests and benchmarks. `OutputProcessor.process` is the HTTP
process's loop over every token of every step: what it does per token is written in it, not
spread over helper calls (docs/engine.md, "One token's path").
"""

from __future__ import annotations

import logging
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
from weights.tokenizer import GPT2Tokenizer

log = logging.getLogger(__name__)


class TextStream:
    """One sequence's output text, released piece by piece as tokens arrive, cut at stop strings."""

    def __init__(self, tokenizer: GPT2Tokenizer, stop: tuple[str, ...] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._step = tokenizer.stream_decoder()
        self._stop = stop
        self._unreleased: list[int] = []  # ids the decoder has taken without releasing their text
        self._held = ""
        self._pieces: list[str] = []  # everything released so far
        self.stopped = False  # a stop string was found; nothing more is released

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def add(self, token_id: int) -> str:
        """Take the next token; return the text it makes safe to show (often '' or one word)."""
        if self.stopped:
            return ""
        piece = self._step(token_id)
        if piece is None:
            self._unreleased.append(token_id)  # an incomplete character: wait for its bytes
            return ""
        self._unreleased.clear()
        if not self._stop:  # nothing to hold back: the decoder's text is released as it is
            self._pieces.append(piece)
            return piece
        return self._release(piece, final=False)

    def finish(self) -> str:
        """The sequence ended: release what was held (and any incomplete bytes, as U+FFFD)."""
        if self.stopped:
            return ""
        # The released text ends on a whole character, so the rest decodes on its own as it
        # would at the end of decoding every token.
        rest = self._tokenizer.decode(self._unreleased, skip_special_tokens=True)
        self._unreleased.clear()
        return self._release(rest, final=True)

    def _release(self, piece: str, final: bool) -> str:
        if not self._stop:
            self._pieces.append(piece)
            return piece
        held = self._held + piece
        cut = self._first_stop(held)
        if cut is not None:
            self.stopped = True
            out, self._held = held[:cut], ""
        else:
            keep = 0 if final else self._partial_stop_suffix(held)
            out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        self._pieces.append(out)
        return out

    def _first_stop(self, text: str) -> int | None:
        """Index where the earliest stop string starts in text, or None."""
        found = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest end of text that some stop string starts with."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


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
    token_events: bool = True  # False: its caller wants its result alone, no TokenEvents
    seed: int | None = None
    queue_seconds: float | None = None
    first_token_time: float | None = None
    prompt_scores: PromptScores | None = None

    @property
    def all_ended(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


@dataclass
class ProcessedStep:
    events: dict[str, list[TokenEvent]]  # each request's token events of the step, in order
    finished: list[FinishedRequest]
    failed: list[RequestFailed]
    abort: list[str]  # requests every sequence of which ended here (stop strings): abort in the core


class OutputProcessor:
    def __init__(self, tokenizer: GPT2Tokenizer, clock: Callable[[], float] = time.monotonic) -> None:
        self.tokenizer = tokenizer
        self.clock = clock
        self._requests: dict[str, RequestOutput] = {}

    def add(self, requests: list[GenerationRequest], token_events: bool = True) -> None:
        """Without `token_events` a request's tokens make no TokenEvents: its result says it all."""
        for request in requests:
            params = request.params
            # Beam search streams nothing: its hypotheses arrive whole when it is done.
            count = 0 if params.num_beams > 1 else params.num_return_sequences
            streams = [SequenceOutput(TextStream(self.tokenizer, params.stop)) for _ in range(count)]
            self._requests[request.request_id] = RequestOutput(request, streams, token_events)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def process(self, step: CoreStep) -> ProcessedStep:
        now = self.clock()
        out = ProcessedStep({}, [], [], [])
        requests, events = self._requests, out.events
        for started in step.started:
            request = requests.get(started.request_id)
            if request is not None:
                request.seed = started.seed
                request.queue_seconds = started.queue_seconds
                request.prompt_scores = started.prompt_scores
                if not request.sequences:  # beam search: its first step is this one
                    request.first_token_time = now
        tokens = step.tokens
        reasons, tops = tokens.reasons, tokens.top  # by position; most steps have none
        for position, (request_id, index, token, logprob) in enumerate(
            zip(tokens.request_ids, tokens.indexes, tokens.token_ids, tokens.logprobs)
        ):
            request = requests.get(request_id)
            if request is None:
                continue  # finished here already; the core has not heard yet
            seq = request.sequences[index]
            if seq.finish_reason is not None:
                continue
            reason = reasons.get(position) if reasons else None  # the core ended the sequence with it
            top = tops.get(position) if tops else None
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            if top is not None:
                seq.top_logprobs.append(top)
            seq.token_times.append(now)
            stream = seq.text
            try:
                text = stream.add(token)
                if stream.stopped or reason is not None:
                    text += stream.finish()
                    seq.finish_reason = "stop_sequence" if stream.stopped else reason
            except Exception as exc:  # this request's text alone: it fails, every other goes on
                out.failed.append(self._fail(request_id, exc, events))
                out.abort.append(request_id)
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            if request.token_events:
                event = TokenEvent(request_id, index, token, text, logprob, now, top)
                mine = events.get(request_id)
                if mine is None:
                    events[request_id] = [event]
                else:
                    mine.append(event)
            if reason is None and stream.stopped and request.all_ended:
                # Ended by stop strings, which only this side sees: the core would run on.
                out.abort.append(request_id)
                out.finished.append(self._finish(request, now))
        for done in step.done:
            request = requests.get(done.request_id)
            if request is not None:
                try:
                    out.finished.append(self._finish(request, now, done.beams))
                except Exception as exc:  # decoding its hypotheses failed: it alone fails
                    out.failed.append(self._fail(done.request_id, exc, events))
        for failed in step.failed:
            if requests.pop(failed.request_id, None) is not None:
                out.failed.append(failed)
        return out

    def abort(self, request_id: str) -> FinishedRequest | None:
        """The client left: finish the request now with what it has (None if already finished)."""
        request = self._requests.get(request_id)
        return None if request is None else self._finish(request, self.clock())

    def _fail(self, request_id: str, exc: Exception, events: dict[str, list[TokenEvent]]) -> RequestFailed:
        """A request whose text could not be made (a tokenizer's or a stop string's error) ends
        alone, with an internal error and none of this step's events; the caller asks the core to
        stop it."""
        log.exception("making the text of request %s failed; it fails alone", request_id)
        self._requests.pop(request_id, None)
        events.pop(request_id, None)
        return RequestFailed(request_id, f"its output text could not be made: {type(exc).__name__}: {exc}", cause="output")

    def fail_all(self, message: str) -> list[RequestFailed]:
        """The core is gone: every request still here fails."""
        failed = [RequestFailed(request_id, message, cause="core_exit") for request_id in self._requests]
        self._requests.clear()
        return failed

    def fail_requests(self, request_ids, message: str) -> list[RequestFailed]:
        """These requests (those still here) fail: their step's output was lost."""
        return [RequestFailed(request_id, message, cause="output") for request_id in request_ids
                if self._requests.pop(request_id, None) is not None]

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
