"""The HTTP side of a generation: submit to the engine core, wait or stream, cancel on disconnect.

Every FinishedRequest goes through `_finished` exactly once, so the token counters equal what
the responses report, cancelled requests included (they finish when cancelled).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request

from service.http.client import EngineClient, TokenSink
from service.http.sse import wait_for_disconnect
from service.common.errors import ApiError, overloaded_error, validation_error
from service.common.metrics import Metrics, set_outcome
from service.engine.types import (
    EngineStopped,
    FinishedRequest,
    GenerationRequest,
    QueueFull,
    RequestFailed,
    TokenEvent,
)

Item = TokenEvent | FinishedRequest | RequestFailed


@dataclass
class Stream:
    """One submitted request and the queue its results arrive on."""

    request: GenerationRequest
    queue: asyncio.Queue
    finished: FinishedRequest | None = None
    failed: bool = False


@dataclass
class CallStreams:
    """The requests of one HTTP call, finished or cancelled together."""

    streams: list[Stream]
    closed: bool = False


class Generations:
    def __init__(self, client: EngineClient, metrics: Metrics, retry_after_seconds: int) -> None:
        self.client = client
        self.metrics = metrics
        self.retry_after_seconds = retry_after_seconds

    # --- submission ---------------------------------------------------------------------------
    def submit(self, requests: list[GenerationRequest], token_events: bool = True) -> CallStreams:
        try:
            queues = self.client.submit(requests, token_events)
        except QueueFull as exc:
            raise overloaded_error(f"too many requests waiting ({exc}); retry later", self.retry_after_seconds) from exc
        except EngineStopped as exc:
            raise ApiError(503, "overloaded", f"{exc}; retry on another replica", {"Retry-After": "5"}) from exc
        except ValueError as exc:
            raise validation_error(str(exc)) from exc
        return CallStreams([Stream(r, q) for r, q in zip(requests, queues)])

    # --- whole answers ------------------------------------------------------------------------
    async def complete(self, requests: list[GenerationRequest], http: Request) -> list[FinishedRequest] | None:
        """Wait for every request of the call; None if the client left first (all cancelled)."""
        batch = self.submit(requests, token_events=False)  # the results say it all
        waiting = asyncio.ensure_future(self._all_finished(batch))
        gone = asyncio.ensure_future(wait_for_disconnect(http.receive))
        try:
            await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
            if waiting.done():
                return waiting.result()  # raises the ApiError of a failed request
            set_outcome(http, "cancelled")
            return None
        finally:
            for task in (gone, waiting):
                task.cancel()
            # Awaited, so no exception of theirs is left unretrieved (and logged) when the client left.
            await asyncio.gather(gone, waiting, return_exceptions=True)
            self.close(batch)

    async def _all_finished(self, batch: CallStreams) -> list[FinishedRequest]:
        return [await self._until_finished(stream) for stream in batch.streams]

    async def _until_finished(self, stream: Stream) -> FinishedRequest:
        while True:
            item = await stream.queue.get()
            if self._take(stream, item):
                return stream.finished

    # --- streaming --------------------------------------------------------------------------
    async def events(
        self, batch: CallStreams, http: Request, direct: TokenSink | None = None
    ) -> AsyncIterator[list[tuple[int, list[Item]]]]:
        """What arrived together, until all finish: (index of the request in the batch, its items)
        for every request that has news, so that a step's events for a call make one write.

        Items are in arrival order; a request's last TokenEvent and its FinishedRequest come out
        in the same list when the engine delivered them in the same step, so a stream can put
        the final details on the last token, as TGI does.

        `direct` (one request only): once the first items have been yielded, and whenever this
        waits with nothing queued, the core reader hands the request's token events to `direct`
        (which writes them to the client itself) until it declines some; those never come out here.
        """
        pending: dict[asyncio.Future, int] = {}
        try:
            if len(batch.streams) == 1:
                # One request (every TGI stream): wait on its queue itself, with no task per wake.
                stream, ended, yielded = batch.streams[0], False, False
                request_id = stream.request.request_id
                while not ended:
                    # Not before the first yield: the response's first chunk (and its keep-alive
                    # pings until then) go out through the response itself.
                    if direct is not None and yielded and stream.queue.empty():
                        self.client.hand_off(request_id, direct)
                    try:
                        items = [await stream.queue.get()] + drain_now(stream.queue)
                    finally:
                        self.client.take_back(request_id)
                    ended = any([self._take(stream, item) for item in items])
                    yield [(0, items)]
                    yielded = True  # and, when this resumes, written by the response
                return
            for index, stream in enumerate(batch.streams):
                pending[asyncio.ensure_future(stream.queue.get())] = index
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                arrived = []
                for future in sorted(done, key=pending.__getitem__):
                    index = pending.pop(future)
                    stream = batch.streams[index]
                    items = [future.result()] + drain_now(stream.queue)
                    ended = [self._take(stream, item) for item in items]
                    if not any(ended):
                        pending[asyncio.ensure_future(stream.queue.get())] = index
                    arrived.append((index, items))
                yield arrived
        finally:
            for future in pending:
                future.cancel()
            self.end(batch, http)

    def end(self, batch: CallStreams, http: Request) -> None:
        """A stream is over. Unfinished without an engine failure means the client left."""
        if not batch.closed and any(s.finished is None for s in batch.streams):
            if not any(s.failed for s in batch.streams):
                set_outcome(http, "cancelled")
        self.close(batch)

    # --- bookkeeping --------------------------------------------------------------------------
    def _take(self, stream: Stream, item: Item) -> bool:
        """Record a finished request; True when the stream has ended."""
        if isinstance(item, FinishedRequest):
            stream.finished = item
            self._finished(item)
            return True
        if isinstance(item, RequestFailed):
            stream.failed = True
            self.metrics.request_failures.labels(cause=item.cause).inc()
            if item.status == 404:  # its adapter was unloaded after the HTTP side checked it
                raise ApiError(404, "not_found", item.message)
            if item.status == 500:
                raise ApiError(500, "generation", f"generation failed: {item.message}")
            raise ApiError(item.status, item.error_type, item.message)  # its own rows failed (engine/faults.py)
        return False

    def close(self, batch: CallStreams) -> None:
        """The call is over: cancel what has not finished (the client left, or an error).

        Idempotent: the streaming response calls it again when it ends, in case the event
        generator never started. Cancelled requests are counted with what they produced.
        """
        if batch.closed:
            return
        batch.closed = True
        for stream in [s for s in batch.streams if s.finished is None and not s.failed]:
            finished = self.client.cancel(stream.request.request_id)
            if finished is not None:
                stream.finished = finished
                self._finished(finished)

    def _finished(self, result: FinishedRequest) -> None:
        m = self.metrics
        m.queue_duration.observe(result.queue_seconds)
        if result.first_token_seconds is not None:
            m.time_to_first_token.observe(result.first_token_seconds)
        m.prompt_tokens.inc(result.prompt_tokens)
        m.generated_tokens.inc(result.generated_tokens)
        for seq in result.sequences:
            for before, after in zip(seq.token_times, seq.token_times[1:]):
                m.inter_token_latency.observe(after - before)


def drain_now(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
