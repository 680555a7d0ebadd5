"""Writing a streamed response's body chunks straight to the connection, with no task between.

A token of an event stream used to travel: the core reader puts it on the stream's queue, the
event loop wakes the response's task, which resumes three generators (the queue wait, the
route's event formatting, the response's loop) and awaits uvicorn's `send`, which writes it.
That is one task wake-up and a dozen Python frames per token per stream, the largest share of
the HTTP process's CPU per streamed token (docs/api-servers.md). The core reader can instead
format the token's event and write it to the connection itself, synchronously, while the
response's task sleeps: BodyWriter is that write, as uvicorn's httptools protocol would frame it.

It writes only while nothing can go wrong by skipping uvicorn's `send`: the response has started
with chunked encoding and is not complete, the client is connected, and the transport is not
over its high-water mark (uvicorn's `send` would wait for it to drain; here the caller falls back
to the queue, and the response's task sends the chunk through `send`, which waits). It reads
uvicorn's RequestResponseCycle (the fields `write_events` checks): pyproject.toml pins uvicorn, and
tests/reliability/test_uvicorn_internals.py checks them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from starlette.types import Send
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from service.engine.types import TokenEvent


class BodyWriter:
    def __init__(self, cycle: RequestResponseCycle) -> None:
        self.cycle = cycle

    def token_sink(self, event_bytes: Callable[[TokenEvent], bytes]) -> Callable[[list[TokenEvent]], bool]:
        """A sink for EngineClient.hand_off: write_events with the route's `event_bytes`."""
        return partial(self.write_events, event_bytes)

    def write_events(self, event_bytes: Callable[[TokenEvent], bytes], events: list[TokenEvent]) -> bool:
        """Write the events (`event_bytes` of each) as one body chunk, framed as uvicorn frames it,
        if it can be written now, before any other chunk this response has yet to send; else
        write nothing and return False. `event_bytes` is called only for events that are written."""
        cycle = self.cycle
        if not (
            cycle.response_started
            and cycle.chunked_encoding is True
            and not cycle.response_complete
            and not cycle.disconnected
            and not cycle.flow.write_paused
            and not cycle.transport.is_closing()
        ):
            return False
        body = b"".join(map(event_bytes, events))
        cycle.transport.write(b"%x\r\n%s\r\n" % (len(body), body))
        return True


def body_writer(server_send: Send | None) -> BodyWriter | None:
    """A writer for the response `server_send` (the server's own `send`, service/http/sse.py
    SERVER_SEND) belongs to, when the server is uvicorn's httptools protocol; None otherwise
    (another server, a test client): the stream then sends every chunk through `send`."""
    cycle = getattr(server_send, "__self__", None)
    return BodyWriter(cycle) if isinstance(cycle, RequestResponseCycle) else None
