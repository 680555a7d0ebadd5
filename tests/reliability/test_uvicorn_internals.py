"""What service/http/server.py and service/http/body_writer.py read of uvicorn's internals,
checked on the installed uvicorn and httptools.

No documented uvicorn hook gives read deadlines for headers and bodies, a limit on the headers'
size with httptools, or a connection cap that closes idle connections instead of holding them
(server.py says why), so GuardedProtocol subclasses uvicorn's HttpToolsProtocol, extending the
parser's callbacks, and DrainingServer reads the server's connections; BodyWriter writes a
streamed response's chunks past uvicorn's `send`, reading its RequestResponseCycle. pyproject.toml pins uvicorn
and httptools to the ranges these pass with; a version that moves any of it fails here, naming
what moved, rather than in the live tests with a timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import json

import httptools
import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from service.http.body_writer import body_writer
from service.http.server import BODY, HEAD, MAX_HEAD_BYTES, DrainingServer, GuardedProtocol


def expect(ok: bool, what: str) -> None:
    assert ok, (
        f"uvicorn {uvicorn.__version__} / httptools {httptools.__version__} changed what "
        f"service/http/server.py relies on: {what}. Adapt GuardedProtocol / DrainingServer to it, "
        "then widen the range in pyproject.toml."
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
    config = uvicorn.Config(ok_app, http=GuardedProtocol, ws="none", lifespan="off", log_config=None)
    config.load()
    return config


@pytest.mark.parametrize(("owner", "method", "parameters"), [
    (HttpToolsProtocol, "connection_made", ["self", "transport"]),
    (HttpToolsProtocol, "data_received", ["self", "data"]),
    (HttpToolsProtocol, "connection_lost", ["self", "exc"]),
    (HttpToolsProtocol, "send_400_response", ["self", "msg"]),
    (HttpToolsProtocol, "on_message_begin", ["self"]),
    (HttpToolsProtocol, "on_url", ["self", "url"]),
    (HttpToolsProtocol, "on_header", ["self", "name", "value"]),
    (HttpToolsProtocol, "on_headers_complete", ["self"]),
    (HttpToolsProtocol, "on_message_complete", ["self"]),
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


def open_connection(server_state: ServerState | None = None) -> tuple[GuardedProtocol, Transport]:
    protocol = GuardedProtocol(server_config(), server_state or ServerState(), {}, _loop=asyncio.get_running_loop())
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport


async def a_request_through_the_guarded_protocol() -> None:
    server_state = ServerState()
    protocol, transport = open_connection(server_state)
    expect(protocol.connections is server_state.connections and protocol in protocol.connections,
           "HttpToolsProtocol.connections is no longer the server's set of open connections")
    expect(protocol.transport is transport and protocol.loop is asyncio.get_running_loop(),
           "HttpToolsProtocol.transport / .loop moved")
    expect(protocol.flow.read_paused is False, "HttpToolsProtocol.flow.read_paused is gone")
    expect(protocol.cycle is None, "HttpToolsProtocol.cycle is not None before the first request")
    expect(protocol.reading is HEAD and protocol.read_timer is not None, "no header deadline armed on connection")
    expect(protocol._idle(), "a new connection does not count as idle")

    protocol.data_received(b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 4\r\n\r\nab")
    expect(protocol.reading is BODY and protocol.read_timer is not None,
           "on_headers_complete did not come with the headers: no body deadline armed")
    cycle = protocol.cycle
    expect(cycle is not None and cycle.response_complete is False,
           "HttpToolsProtocol.cycle (with response_complete) no longer tracks the request in progress")
    expect(not protocol._idle(), "a connection mid-request counts as idle")

    protocol.data_received(b"cd")
    expect(protocol.reading is None and protocol.read_timer is None,
           "on_message_complete did not come with the body's last byte: a deadline is still armed")
    await until(lambda: cycle.response_complete is True, "RequestResponseCycle.response_complete never turned True")
    expect(b"200" in bytes(transport.written).split(b"\r\n", 1)[0], f"no 200 answered: {bytes(transport.written)!r}")
    expect(protocol._idle(), "a kept-alive connection between requests does not count as idle")

    protocol.data_received(b"\r\n")  # llhttp skips it without a callback: data_received arms the deadline
    expect(protocol.reading is HEAD and protocol.read_timer is not None,
           "the first byte of a kept-alive connection's next request arms no header deadline")
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\nGE")
    expect(protocol.reading is HEAD and protocol.read_timer is not None,
           "a request begun in the read that ended the one before arms no header deadline (on_message_begin)")

    protocol.connection_lost(None)
    expect(protocol not in server_state.connections and protocol.read_timer is None,
           "connection_lost no longer forgets the connection")


def test_a_request_moves_the_state_the_guard_reads():
    asyncio.run(a_request_through_the_guarded_protocol())


async def answer_to(*reads: bytes) -> tuple[bytes, bool]:
    """What the guarded protocol wrote for these reads of one connection, and whether it closed it."""
    protocol, transport = open_connection()
    for data in reads:
        if not transport.closed:
            protocol.data_received(data)
    await asyncio.sleep(0.05)  # a request that got through is answered by its task
    protocol.connection_lost(None)
    return bytes(transport.written), transport.closed


def answer(*reads: bytes) -> tuple[int, dict, bool]:
    written, closed = asyncio.run(answer_to(*reads))
    head, _, body = written.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head else 0
    return status, (json.loads(body) if status >= 400 else {}), closed


def test_uvicorn_answers_malformed_http_through_the_override():
    # send_400_response is called inside uvicorn's `except` for the parser's error: its reason shows.
    status, body, closed = answer(b"NOT HTTP AT ALL\r\n\r\n")
    expect(status == 400 and closed, "malformed HTTP no longer answered 400 and closed through send_400_response")
    expect(body["error_type"] == "validation" and "Invalid method" in body["error"],
           f"the 400 is not the override's JSON error shape with the parser's reason: {body}")


def request_with_header(size: int) -> bytes:
    return b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * size + b"\r\n\r\n"


def test_a_head_past_the_limit_is_refused_before_it_reaches_the_app():
    # on_header comes before on_headers_complete, which starts the app: the refusal beats it.
    status, body, closed = answer(request_with_header(MAX_HEAD_BYTES))
    expect(status == 431 and closed and str(MAX_HEAD_BYTES) in body["error"],
           f"a head past {MAX_HEAD_BYTES} bytes was answered {status}")
    expect(answer(request_with_header(MAX_HEAD_BYTES - 200))[0] == 200, "a head within the limit was refused")


def test_a_header_growing_over_many_reads_is_refused_before_it_ends():
    # httptools keeps a header still incomplete to itself (no callback): the reads are counted.
    start = b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: "
    status, _, closed = answer(start, *[b"a" * 1024] * (MAX_HEAD_BYTES // 1024 + 1))
    expect(status == 431 and closed, f"a header that never ends, past {MAX_HEAD_BYTES} bytes, was answered {status}")


async def pipelined_request_waits_its_turn() -> None:
    protocol, transport = open_connection()
    protocol.header_timeout = protocol.body_timeout = 0.05
    started = asyncio.Event()
    release = asyncio.Event()

    async def slow_app(scope, receive, send) -> None:
        started.set()
        await release.wait()
        await ok_app(scope, receive, send)

    protocol.app = slow_app
    # The first request in progress; the second's headers pipelined behind it, its body not yet read.
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"
                           b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n\r\n")
    await started.wait()
    expect(protocol.flow.read_paused and protocol.reading is BODY,
           "uvicorn no longer pauses reading for a pipelined request")
    await asyncio.sleep(0.2)  # several body deadlines
    expect(not transport.closed, "a body deadline fell while the server held the reading back: first request cut")
    release.set()
    await until(lambda: not protocol.flow.read_paused, "the pipelined request never started")
    await asyncio.sleep(0.2)
    expect(transport.closed, "the pipelined request's body never came, yet its deadline did not close the connection")
    protocol.connection_lost(None)


def test_a_pipelined_requests_body_deadline_waits_for_its_turn():
    asyncio.run(pipelined_request_waits_its_turn())


def test_the_draining_server_finds_its_connections():
    server = DrainingServer(server_config(), drain=None, drain_seconds=1.0)
    expect(isinstance(server.server_state.connections, set), "Server.server_state.connections is not a set")
    expect(isinstance(server.force_exit, bool), "Server.force_exit is gone")
    expect(isinstance(server.config.timeout_graceful_shutdown, (int, float, type(None))),
           "Config.timeout_graceful_shutdown is gone")
    expect(server._in_flight() is False, "a server with no connections reports requests in flight")


async def a_stream_written_past_send() -> None:
    """service/http/body_writer.py writes body chunks to uvicorn's connection itself, between the
    response's own sends: the same framing, and only while uvicorn's `send` would write at once."""
    protocol, transport = open_connection()
    seen: dict[str, bool] = {}
    release = asyncio.Event()

    async def streaming_app(scope, receive, send) -> None:
        writer = body_writer(send)
        expect(writer is not None, "uvicorn's `send` is no longer a RequestResponseCycle's bound method")
        write = writer.token_sink(bytes)  # each "event" its own bytes
        seen["before start"] = write([b"early"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        seen["started"] = write([b"dir", b"ect"])
        await send({"type": "http.response.body", "body": b"sent", "more_body": True})
        protocol.pause_writing()  # the transport is over its high-water mark
        seen["paused"] = write([b"paused"])
        protocol.resume_writing()
        seen["resumed"] = write([b"again"])
        await release.wait()
        seen["disconnected"] = write([b"gone"])
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        seen["complete"] = write([b"after"])

    protocol.app = streaming_app
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
    await until(lambda: "resumed" in seen, "the streaming app never ran")
    head, _, body = bytes(transport.written).partition(b"\r\n\r\n")
    expect(b"transfer-encoding: chunked" in head, "a response without a length is no longer chunked")
    expect(body == b"6\r\ndirect\r\n4\r\nsent\r\n5\r\nagain\r\n",
           f"a chunk written past `send` is framed otherwise, or written when it may not be: {body!r}")
    protocol.connection_lost(None)
    release.set()
    await until(lambda: "complete" in seen, "the streaming app never ended")
    expect(seen == {"before start": False, "started": True, "paused": False, "resumed": True,
                    "disconnected": False, "complete": False},
           f"RequestResponseCycle's state (response_started, chunked_encoding, flow.write_paused, "
           f"disconnected, response_complete) no longer says when a chunk may be written: {seen}")


def test_a_body_writer_writes_as_uvicorn_would_and_only_when_it_would():
    asyncio.run(a_stream_written_past_send())
