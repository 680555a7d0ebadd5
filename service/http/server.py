"""The HTTP server: uvicorn (its httptools protocol), plus what it lacks against idle, slow and
flooding clients, and a drain that keeps answering after SIGTERM.

uvicorn gives a keep-alive timeout, but no timeout for reading a request's headers or body, no
limit on the headers' size with httptools (h11 has one; httptools, llhttp's C parser, is used
because the HTTP process spends ~15% less CPU per streamed token on it: docs/api-servers.md),
and its `limit_concurrency` still accepts and holds every connection (answering 503 only once a
request arrives), so half-open connections use up the file descriptors. Here:

- headers must arrive within `header_timeout_seconds` of the connection (or of the first byte of
  a kept-alive connection's next request), bodies within `body_timeout_seconds`, or the
  connection is closed (a deadline that falls while the server itself holds the reading back,
  a pipelined request waiting its turn, is pushed back);
- a request's head (request line and headers) may take MAX_HEAD_BYTES, h11's default: past it
  the answer is 431 and the connection closes;
- at most `max_connections` are open: one more closes the oldest connection that has no request
  in progress (an idle or half-open one), or, when every one is busy, the new one;
- uvicorn's own 400s (malformed HTTP) carry the service's JSON error shape and the parser's reason.

On SIGTERM uvicorn closes its listening socket at once (clients see "connection refused"); here
it keeps listening while in-flight requests finish (up to `drain_seconds`), and DrainMiddleware
answers new requests 503. Then uvicorn's own shutdown runs with what is left of the drain time.

Both read uvicorn's internals (the protocol's parser callbacks, connections, cycle and flow
control; the server's connection set): pyproject.toml pins uvicorn and httptools to tested
ranges, and tests/reliability/test_uvicorn_internals.py names what moved if a new one changes them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import sys
import time

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from service.http.drain import Drain
from service.engine.gc_heap import freeze_startup_heap
from service.http.logs import log_config
from service.common.errors import error_body
from service.http.log_limit import limit_repeated_lines
from service.settings import Settings

logger = logging.getLogger("uvicorn.error")
FD_RESERVE = 128  # descriptors kept for the model files, logs, and the engine's own needs
# asyncio accepts up to `backlog` connections per wake-up before any of them reaches
# connection_made (where the cap is enforced): that many descriptors must be spare beyond the cap.
# Also the kernel's queue of connections not yet accepted (uvicorn's default is 2048).
BACKLOG = 128
MAX_HEAD_BYTES = 16 * 1024  # h11's max_incomplete_event_size, the limit uvicorn's h11 protocol had
HEAD_TOO_LARGE = f"request line and headers larger than {MAX_HEAD_BYTES} bytes"
HEAD, BODY = "head", "body"  # what a connection's read deadline waits for


class HeadTooLarge(Exception):
    """Raised in a parser callback: llhttp stops, and uvicorn calls send_400_response."""


class GuardedProtocol(HttpToolsProtocol):
    # Set on the subclass that `guarded_protocol` makes for one server.
    max_connections: int = 1000
    header_timeout: float = 10.0
    body_timeout: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.opened_at = time.monotonic()
        self.read_timer: asyncio.TimerHandle | None = None
        self.reading: str | None = None  # HEAD or BODY: what the armed deadline waits for
        # Of the head being read (None between heads): the URL and header bytes the parser handed
        # over, and the bytes of later reads that fell wholly inside it (None during the read it
        # began in). The second counts what llhttp holds of a header still incomplete.
        self.head_fields: int | None = None
        self.head_reads: int | None = None
        if len(self.connections) > self.max_connections:
            self._make_room()
        self._expect(HEAD)

    def data_received(self, data: bytes) -> None:
        if self.read_timer is None:  # the first byte of a kept-alive connection's next request
            self._expect(HEAD)
        super().data_received(data)
        if self.head_fields is None or self.transport.is_closing():
            return
        self.head_reads = 0 if self.head_reads is None else self.head_reads + len(data)
        if self.head_reads > MAX_HEAD_BYTES:
            self._refuse(431, HEAD_TOO_LARGE)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    # The parser's callbacks (uvicorn's own, extended): one deadline for a request's whole head,
    # then one for its body.
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head_fields, self.head_reads = 0, None
        if self.read_timer is None:  # a pipelined request, begun in the read that ended the last
            self._expect(HEAD)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._count_head(len(name) + len(value))

    def on_headers_complete(self) -> None:
        self.head_fields = None
        self._expect(BODY)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._stop_timer()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this inside its `except` for the parser's error, which says what was wrong.
        error = sys.exc_info()[1]
        if isinstance(getattr(error, "__context__", None), HeadTooLarge):
            self._refuse(431, HEAD_TOO_LARGE)
        else:
            self._refuse(400, f"invalid HTTP request: {error or msg}")

    def _count_head(self, size: int) -> None:
        self.head_fields += size  # type: ignore[operator]
        if self.head_fields > MAX_HEAD_BYTES:  # type: ignore[operator]
            raise HeadTooLarge

    def _refuse(self, status: int, message: str) -> None:
        """Answer in the service's error shape and close (uvicorn's own answer is plain text)."""
        body = json.dumps(error_body("validation", message)).encode()
        self.transport.write(STATUS_LINE[status] + b"content-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def _expect(self, reading: str) -> None:
        self._stop_timer()
        self.reading = reading
        limit = self.header_timeout if reading is HEAD else self.body_timeout
        self.read_timer = self.loop.call_later(limit, self._read_timed_out)

    def _stop_timer(self) -> None:
        self.reading = None
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None

    def _read_timed_out(self) -> None:
        self.read_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server holds the reading back, not the client
            self._expect(self.reading)  # type: ignore[arg-type]
            return
        # The app, if it waits for the body, sees a disconnect.
        logger.info("closing a connection that did not send its request in time")
        self.transport.close()

    def _idle(self) -> bool:
        no_request = self.cycle is None or self.cycle.response_complete
        return no_request and self.reading is not BODY and not self.transport.is_closing()

    def _make_room(self) -> None:
        idle = [c for c in self.connections if c is not self and isinstance(c, GuardedProtocol) and c._idle()]
        victim = min(idle, key=lambda c: c.opened_at) if idle else self
        logger.warning("connection limit (%d) reached: closing %s", self.max_connections,
                       "the oldest idle connection" if idle else "the new connection")
        victim.transport.close()


def connection_cap(configured: int) -> int:
    """The configured cap, lowered to fit the process' file-descriptor limit: past it, accept()
    fails in a loop (asyncio logs a traceback per try) and nobody is served."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    spare = FD_RESERVE + BACKLOG
    if soft == resource.RLIM_INFINITY or configured + spare <= soft:
        return configured
    lowered = max(1, soft - spare)
    logger.warning("max_connections %d lowered to %d to fit the open-file limit (%d)", configured, lowered, soft)
    return lowered


def guarded_protocol(settings: Settings) -> type[GuardedProtocol]:
    limits = {
        "max_connections": connection_cap(settings.max_connections),
        "header_timeout": settings.header_timeout_seconds,
        "body_timeout": settings.body_timeout_seconds,
    }
    return type("ServiceProtocol", (GuardedProtocol,), limits)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Drain, drain_seconds: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_seconds = drain_seconds

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            # The lifespan has started the engine core and loaded all this process keeps. Here,
            # not in the lifespan: an app started in a test process (TestClient) must not
            # freeze that process's heap.
            freeze_startup_heap("HTTP")

    def _in_flight(self) -> bool:
        return any(c.cycle is not None and not c.cycle.response_complete for c in self.server_state.connections)

    async def shutdown(self, sockets=None) -> None:
        self.drain.begin()
        deadline = time.monotonic() + self.drain_seconds
        if self._in_flight():
            logger.info("Draining: new requests get 503 while in-flight requests finish")
        while self._in_flight() and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.1)
        self.config.timeout_graceful_shutdown = max(0.0, deadline - time.monotonic())
        await super().shutdown(sockets)


# Python hands the GIL to a waiting thread only every switch interval (5 ms by default). The
# event loop re-takes it after every select(): with one CPU-bound request thread running
# (building a large response, tokenizing), each re-take waited up to 5 ms, and every stream's
# next token with it. 0.5 ms bounds that wait tenfold tighter for a little switching.
SWITCH_INTERVAL_S = 0.0005


def serve(app: FastAPI, settings: Settings, sock: socket.socket | None = None) -> None:
    """`sock`: a listening socket already bound (one of several HTTP processes on one port)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, http=guarded_protocol(settings), backlog=BACKLOG,
        # No websocket routes: an Upgrade is served as plain HTTP, and no websocket protocol takes
        # a connection over from the guarded one.
        ws="none",
        timeout_keep_alive=settings.keep_alive_seconds, timeout_graceful_shutdown=settings.drain_seconds,
        log_config=log_config(settings.log_format), access_log=settings.access_log,
    )
    limit_repeated_lines()  # after uvicorn.Config, which configures logging
    DrainingServer(config, app.state.drain, settings.drain_seconds).run(sockets=None if sock is None else [sock])
