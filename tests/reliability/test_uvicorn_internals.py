"""What service/http/server.py reads of uvicorn's internals, checked on the installed uvicorn.

No documented uvicorn hook gives read deadlines for headers and bodies, or a connection cap that
closes idle connections instead of holding them (server.py says why), so GuardedH11Protocol
subclasses uvicorn's H11Protocol and DrainingServer reads the server's connections. pyproject.toml
pins uvicorn to the range these pass with; a uvicorn that moves any of it fails here, naming what
moved, rather than in the live tests with a timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import json

import h11
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from service.http.server import DrainingServer, GuardedH11Protocol


def expect(ok: bool, what: str) -> None:
    assert ok, (
        f"uvicorn {uvicorn.__version__} changed what service/http/server.py relies on: {what}. "
        "Adapt GuardedH11Protocol / DrainingServer to it, then widen uvicorn's range in pyproject.toml."
    )


class Transport(asyncio.Transport):
    """A connection's transport without a socket: keeps what the protocol writes."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def write(self, data) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def ok_app(scope, receive, send) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def server_config() -> uvicorn.Config:
    config = uvicorn.Config(ok_app, http=GuardedH11Protocol, lifespan="off", log_config=None)
    config.load()
    return config


@pytest.mark.parametrize(("owner", "method", "parameters"), [
    (H11Protocol, "connection_made", ["self", "transport"]),
    (H11Protocol, "data_received", ["self", "data"]),
    (H11Protocol, "connection_lost", ["self", "exc"]),
    (H11Protocol, "send_400_response", ["self", "msg"]),
    (uvicorn.Server, "shutdown", ["self", "sockets"]),
], ids=lambda each: getattr(each, "__name__", str(each)))
def test_the_overridden_methods_keep_their_signatures(owner, method, parameters):
    expect(callable(getattr(owner, method, None)), f"{owner.__name__}.{method} is gone")
    found = list(inspect.signature(getattr(owner, method)).parameters)
    expect(found == parameters, f"{owner.__name__}.{method} takes {found}, not {parameters}")


async def until(condition, what: str) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.01)
    expect(False, what)


async def a_request_through_the_guarded_protocol() -> None:
    loop = asyncio.get_running_loop()
    server_state = ServerState()
    protocol = GuardedH11Protocol(server_config(), server_state, {}, _loop=loop)
    transport = Transport()
    protocol.connection_made(transport)
    expect(protocol.connections is server_state.connections and protocol in protocol.connections,
           "H11Protocol.connections is no longer the server's set of open connections")
    expect(isinstance(protocol.conn, h11.Connection), "H11Protocol.conn is no longer an h11.Connection")
    expect(protocol.transport is transport and protocol.loop is loop, "H11Protocol.transport / .loop moved")
    expect(protocol.cycle is None, "H11Protocol.cycle is not None before the first request")
    expect(protocol.conn.their_state is h11.IDLE and protocol.read_timer is not None,
           "a new connection is not IDLE in h11, so no header deadline is armed")

    protocol.data_received(b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 4\r\n\r\nab")
    expect(protocol.conn.their_state is h11.SEND_BODY, "a request's headers no longer move h11 to SEND_BODY")
    expect(protocol.reading is h11.SEND_BODY and protocol.read_timer is not None, "no body deadline armed")
    cycle = protocol.cycle
    expect(cycle is not None and cycle.response_complete is False,
           "H11Protocol.cycle (with response_complete) no longer tracks the request in progress")
    expect(not protocol._idle(), "a connection mid-request counts as idle")

    protocol.data_received(b"cd")
    await until(lambda: cycle.response_complete is True, "RequestResponseCycle.response_complete never turned True")
    await until(lambda: protocol.conn.their_state is h11.IDLE, "h11 is not back to IDLE after the response")
    expect(b"200" in bytes(transport.written).split(b"\r\n", 1)[0], f"no 200 answered: {bytes(transport.written)!r}")
    expect(protocol._idle(), "a kept-alive connection between requests does not count as idle")

    protocol.connection_lost(None)
    expect(protocol not in server_state.connections and protocol.read_timer is None,
           "connection_lost no longer forgets the connection")


def test_a_request_moves_the_state_the_guard_reads():
    asyncio.run(a_request_through_the_guarded_protocol())


async def malformed_http_through_the_guarded_protocol() -> bytes:
    protocol = GuardedH11Protocol(server_config(), ServerState(), {}, _loop=asyncio.get_running_loop())
    transport = Transport()
    protocol.connection_made(transport)
    protocol.data_received(b"NOT HTTP AT ALL\r\n\r\n")
    expect(transport.closed, "malformed HTTP no longer closes the connection through send_400_response")
    protocol.connection_lost(None)
    return bytes(transport.written)


def test_uvicorn_answers_malformed_http_through_the_override():
    head, _, body = asyncio.run(malformed_http_through_the_guarded_protocol()).partition(b"\r\n\r\n")
    expect(head.startswith(b"HTTP/1.1 400"), f"malformed HTTP answered {head!r}")
    expect(json.loads(body)["error_type"] == "validation", "the 400 is not the override's JSON error shape")


def test_the_draining_server_finds_its_connections():
    server = DrainingServer(server_config(), drain=None, drain_seconds=1.0)
    expect(isinstance(server.server_state.connections, set), "Server.server_state.connections is not a set")
    expect(isinstance(server.force_exit, bool), "Server.force_exit is gone")
    expect(isinstance(server.config.timeout_graceful_shutdown, (int, float, type(None))),
           "Config.timeout_graceful_shutdown is gone")
    expect(server._in_flight() is False, "a server with no connections reports requests in flight")
