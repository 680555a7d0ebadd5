"""Server-sent events: the wire format, and a response that always releases its engine work."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi.sse import KEEPALIVE_COMMENT, format_sse_event
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

# Proxies (nginx) must pass events through as they come, not buffer the response.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = format_sse_event(data_str="[DONE]")
# As FastAPI's own SSE routes: a comment line (`: ping`) every 15 s of silence keeps proxies and
# load balancers from closing a connection that waits in the queue for its first token.
KEEPALIVE_SECONDS = 15.0


def sse(payload: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(payload, ensure_ascii=False))


async def keepalive_until_first(content: AsyncIterator[bytes], interval: float) -> AsyncIterator[bytes]:
    """`content`, preceded by a keep-alive comment for every `interval` seconds it takes to
    produce its first chunk. After that the chunks pass straight through: once tokens flow, the
    gaps between them are an inter-token latency, and timing each one would cost every token."""
    first = asyncio.ensure_future(anext(content, None))
    try:
        while not (await asyncio.wait({first}, timeout=interval))[0]:
            yield KEEPALIVE_COMMENT
        chunk = first.result()
    finally:
        first.cancel()
    if chunk is None:
        return
    yield chunk
    async for chunk in content:
        yield chunk


class EventStream(StreamingResponse):
    """A text/event-stream response that calls `on_close` however it ends.

    When the client disconnects, Starlette cancels the response task; an async generator that
    had not started (or is parked at a yield) would never run its `finally`, and the engine
    would keep generating for nobody. `on_close` cancels what has not finished.
    Each chunk of `content` is one socket write: a step's events for a call go in one chunk.
    """

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], None], keepalive_seconds: float = KEEPALIVE_SECONDS
    ) -> None:
        super().__init__(keepalive_until_first(content, keepalive_seconds), media_type="text/event-stream",
                         headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
