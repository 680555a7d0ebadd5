"""Server-sent events: the wire format, and a response that always releases its engine work."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi.sse import format_sse_event
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

# Proxies (nginx) must pass events through as they come, not buffer the response.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = format_sse_event(data_str="[DONE]")


def sse(payload: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(payload, ensure_ascii=False))


class EventStream(StreamingResponse):
    """A text/event-stream response that calls `on_close` however it ends.

    When the client disconnects, Starlette cancels the response task; an async generator that
    had not started (or is parked at a yield) would never run its `finally`, and the engine
    would keep generating for nobody. `on_close` cancels what has not finished.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
