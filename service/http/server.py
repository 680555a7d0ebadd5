"""The HTTP server: uvicorn (h11), plus what it lacks against idle, slow and flooding clients,
and a drain that keeps answering after SIGTERM.

uvicorn gives a keep-alive timeout and a header-size limit (h11_max_incomplete_event_size), but
no timeout for reading a request's headers or body, and its `limit_concurrency` still accepts
and holds every connection (answering 503 only once a request arrives), so half-open
connections use up the file descriptors. Here:

- headers must arrive within `header_timeout_seconds` of the connection (or of the first byte of
  a kept-alive connection's next request), bodies within `body_timeout_seconds`, or the
  connection is closed;
- at most `max_connections` are open: one more closes the oldest connection that has no request
  in progress (an idle or half-open one), or, when every one is busy, the new one;
- uvicorn's own 400s (malformed HTTP) carry the service's JSON error shape.

On SIGTERM uvicorn closes its listening socket at once (clients see "connection refused"); here
it keeps listening while in-flight requests finish (up to `drain_seconds`), and DrainMiddleware
answers new requests 503. Then uvicorn's own shutdown runs with what is left of the drain time.

Both read uvicorn's internals (the protocol's connections, cycle and h11 connection; the server's
connection set): pyproject.toml pins uvicorn to a tested range, and
tests/reliability/test_uvicorn_internals.py names what moved if a new uvicorn changes them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import sys
import time

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.http.drain import Drain
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


class GuardedH11Protocol(H11Protocol):
    # Set on the subclass that `guarded_protocol` makes for one server.
    max_connections: int = 1000
    header_timeout: float = 10.0
    body_timeout: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.opened_at = time.monotonic()
        self.read_timer: asyncio.TimerHandle | None = None
        self.reading: object = None  # the h11 state the timer was armed for
        if len(self.connections) > self.max_connections:
            self._make_room()
        self._watch_reading()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        # uvicorn's own (plain text); same status, same closing, the service's error shape.
        body = json.dumps(error_body("validation", f"invalid HTTP request: {msg}")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _watch_reading(self) -> None:
        """One deadline for the whole of a request's headers, then one for its body."""
        state = self.conn.their_state
        if state is h11.IDLE:
            limit = self.header_timeout
        elif state is h11.SEND_BODY:
            limit = self.body_timeout
        else:  # the request is read (or the connection is ending): no client deadline
            self._stop_timer()
            self.reading = state
            return
        if self.reading is not state:
            self._stop_timer()
            self.reading = state
            self.read_timer = self.loop.call_later(limit, self._read_timed_out)

    def _stop_timer(self) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None

    def _read_timed_out(self) -> None:
        self.read_timer = None
        if not self.transport.is_closing():
            # The app, if it waits for the body, sees a disconnect.
            logger.info("closing a connection that did not send its request in time")
            self.transport.close()

    def _idle(self) -> bool:
        no_request = self.cycle is None or self.cycle.response_complete
        return no_request and self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _make_room(self) -> None:
        idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol) and c._idle()]
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


def guarded_protocol(settings: Settings) -> type[GuardedH11Protocol]:
    limits = {
        "max_connections": connection_cap(settings.max_connections),
        "header_timeout": settings.header_timeout_seconds,
        "body_timeout": settings.body_timeout_seconds,
    }
    return type("ServiceH11Protocol", (GuardedH11Protocol,), limits)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Drain, drain_seconds: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_seconds = drain_seconds

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
        timeout_keep_alive=settings.keep_alive_seconds, timeout_graceful_shutdown=settings.drain_seconds,
        log_config=log_config(settings.log_format),
    )
    limit_repeated_lines()  # after uvicorn.Config, which configures logging
    DrainingServer(config, app.state.drain, settings.drain_seconds).run(sockets=None if sock is None else [sock])
