"""Server-sent events: the wire format, and a response that always releases its engine work."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine

from fastapi.sse import KEEPALIVE_COMMENT, format_sse_event
from json.encoder import encode_basestring as json_string  # a str as json.dumps(ensure_ascii=False) writes it
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

# Proxies (nginx) must pass events through as they come, not buffer the response.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = format_sse_event(data_str="[DONE]")
# As FastAPI's own SSE routes: a comment line (`: ping`) every 15 s of silence keeps proxies and
# load balancers from closing a connection that waits in the queue for its first token.
KEEPALIVE_SECONDS = 15.0
# The server's own `send`, put in the scope by the application (service/app.py) before any
# middleware wraps it. Every middleware of this service acts on a response's start message alone
# (its status, its headers): a stream's body chunks, one per engine step, go straight to the
# server instead of through each wrapper that would only pass them on.
SERVER_SEND = "gpt2.server_send"

encode_json = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps(..., ensure_ascii=False)


def sse(payload: dict) -> bytes:
    """One `data:` event: the bytes fastapi.sse.format_sse_event makes of
    json.dumps(payload, ensure_ascii=False), built directly (JSON has no raw line breaks, so the
    data is always one line)."""
    return b"data: " + encode_json(payload).encode() + b"\n\n"


async def keepalive_until_first(content: AsyncIterator[bytes], interval: float) -> AsyncIterator[bytes]:
    """A keep-alive comment for every `interval` seconds `content` takes to produce its first
    chunk, then that chunk, and no more: the caller reads the rest from `content` itself. Once
    tokens flow, the gaps between them are an inter-token latency, and timing each one would cost
    every token."""
    first = asyncio.ensure_future(anext(content, None))
    try:
        while not (await asyncio.wait({first}, timeout=interval))[0]:
            yield KEEPALIVE_COMMENT
        chunk = first.result()
    finally:
        first.cancel()
    if chunk is not None:
        yield chunk


class EventStream(StreamingResponse):
    """A text/event-stream response that calls `on_close` however it ends.

    When the client disconnects, the response is cancelled (until_disconnect, as Starlette's
    StreamingResponse does); an async generator that had not started (or is parked at a yield)
    would never run its `finally`, and the engine would keep generating for nobody. `on_close`
    cancels what has not finished.
    Each chunk of `content` is one socket write: a step's events for a call go in one chunk.
    """

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], None], keepalive_seconds: float = KEEPALIVE_SECONDS
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close
        self.keepalive_seconds = keepalive_seconds
        self._send_body: Send | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._send_body = scope.get(SERVER_SEND, send)
        try:
            await until_disconnect(self.stream_response(send), receive)
        finally:
            self.on_close()

    async def stream_response(self, send: Send) -> None:
        # The start goes through the middlewares (request id header, metrics' status); the body
        # chunks do not need them.
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        send_body = self._send_body or send
        content = self.body_iterator
        async for chunk in keepalive_until_first(content, self.keepalive_seconds):
            await send_body({"type": "http.response.body", "body": chunk, "more_body": True})
        async for chunk in content:
            await send_body({"type": "http.response.body", "body": chunk, "more_body": True})
        await send_body({"type": "http.response.body", "body": b"", "more_body": False})


async def until_disconnect(response: Coroutine[None, None, None], receive: Receive) -> None:
    """Run `response` until it ends, or cancel it when the client disconnects first; its errors
    are raised. What Starlette's StreamingResponse does with an anyio task group, in two asyncio
    tasks: anyio builds a cancel scope, task handles and events for each response (~40 µs per
    task handle here), a cost paid by every streamed request (docs/api-servers.md)."""
    sending = asyncio.ensure_future(response)
    listening = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({sending, listening}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (listening, sending):
            task.cancel()
        # Whatever ended them, both are over before the response's own cleanup runs.
        await asyncio.gather(listening, sending, return_exceptions=True)
    if not sending.cancelled():
        sending.result()


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client closes the connection (the request's body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
