"""A live server against clients that hold connections open, trickle bytes, or send what HTTP
forbids: it keeps answering /health, closes what it must, answers in its JSON error shape, and
its log stays bounded. Raw sockets on loopback, every wait bounded."""

from __future__ import annotations

import signal
import threading
from contextlib import ExitStack

import httpx
import pytest

from service.http.server import MAX_HEAD_BYTES
from tests.reliability.rawhttp import closed_by_server, connect, exchange, read_response
from tests.service.live import WAIT_S, live_server, wait_until

pytestmark = pytest.mark.slow

IDLE_CONNECTIONS = 600  # more than the server may hold, and than its descriptors allow
OPEN_FILES = 512  # the cap (50) plus the server's spare descriptors (service/http/server.py) fit
MAX_CONNECTIONS = 50


@pytest.fixture(scope="module")
def capped(tiny_model_dir):
    # Only the cap defends here: read timeouts longer than the test.
    with live_server(tiny_model_dir, open_files=OPEN_FILES, max_connections=MAX_CONNECTIONS,
                     header_timeout_seconds=300, keep_alive_seconds=300) as server:
        yield server


@pytest.fixture(scope="module")
def strict(tiny_model_dir):
    # Short read timeouts; a long keep-alive, so a close right after a response is the server's choice.
    with live_server(tiny_model_dir, header_timeout_seconds=1, body_timeout_seconds=1, keep_alive_seconds=300) as server:
        yield server


def test_idle_connections_beyond_the_cap_do_not_starve_health(capped):
    with ExitStack() as stack:
        idle = [stack.enter_context(connect(capped.port)) for _ in range(IDLE_CONNECTIONS)]
        half_open = idle[::2]
        for sock in half_open:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: local")  # headers never finished
        for _ in range(5):
            assert capped.get("/health").status_code == 200
        # The oldest idle connections were closed to make room: at most the cap stay open.
        closed = sum(closed_by_server(sock, within_s=0.2) for sock in idle)
        assert closed >= IDLE_CONNECTIONS - MAX_CONNECTIONS
    log = capped.log()
    # One warning per eviction, rate-limited: the first ten and nothing more this minute.
    assert log.count("connection limit") <= 10, log[-3000:]
    assert "Traceback" not in log


def test_headers_that_trickle_in_are_cut_off(strict):
    with connect(strict.port) as sock:
        sent = 0
        request = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 200
        stop = threading.Event()

        def trickle():
            nonlocal sent
            for byte in request:
                if stop.wait(0.05):
                    return
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    return
                sent += 1

        sender = threading.Thread(target=trickle)
        sender.start()
        try:
            assert closed_by_server(sock, within_s=WAIT_S)
        finally:
            stop.set()
            sender.join()
        assert sent < len(request), "the server waited for the whole trickle"


@pytest.mark.parametrize("next_bytes", [b"GET /health HTTP/1.1\r\nHost: local", b"\r\n"], ids=["headers", "crlf"])
def test_a_kept_alive_connections_next_headers_are_cut_off(strict, next_bytes):
    # The header deadline counts from the next request's first byte, not from the connection;
    # without it only the 300 s keep-alive would end this one (the first byte cancels it).
    with connect(strict.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert read_response(sock).status == 200
        sock.sendall(next_bytes)
        assert closed_by_server(sock, within_s=WAIT_S)


def test_headers_past_the_limit_are_refused_431_and_closed(strict):
    big = b"X-Big: " + b"a" * MAX_HEAD_BYTES + b"\r\n"
    response, sock = exchange(strict.port, b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + big + b"\r\n")
    with sock:
        assert response.status == 431
        assert response.json()["error_type"] == "validation" and str(MAX_HEAD_BYTES) in response.json()["error"]
        assert closed_by_server(sock, within_s=WAIT_S / 4)
    # h11's limit was the same: a head just within it is served.
    within = b"X-Big: " + b"a" * (MAX_HEAD_BYTES - 200) + b"\r\n"
    response, sock = exchange(strict.port, b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + within + b"\r\n")
    with sock:
        assert response.status == 200


def test_a_body_that_never_arrives_is_cut_off(strict):
    with connect(strict.port) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"inputs\": ")
        assert closed_by_server(sock, within_s=WAIT_S)
    assert strict.get("/health").status_code == 200


def test_content_length_with_transfer_encoding_is_refused_and_closed(strict):
    body = b'{"inputs": "hi"}'
    request = (b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
               b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
               + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    response, sock = exchange(strict.port, request)
    with sock:
        assert response.status == 400
        assert response.json()["error_type"] == "validation" and "Transfer-Encoding" in response.json()["error"]
        assert response.headers.get("connection") == "close"
        assert closed_by_server(sock, within_s=WAIT_S / 4)  # well before the 300 s keep-alive


def test_malformed_http_is_answered_in_the_json_error_shape(strict):
    response, sock = exchange(strict.port, b"NOT HTTP AT ALL\r\n\r\n")
    with sock:
        assert response.status == 400
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error_type"] == "validation"


def test_foreign_host_names_are_refused_when_bound_to_loopback(strict):
    for host in ("localhost", f"localhost:{strict.port}", "127.0.0.1", f"[::1]:{strict.port}"):
        assert httpx.get(strict.url + "/health", headers={"Host": host}).status_code == 200, host
    rebound = httpx.get(strict.url + "/info", headers={"Host": "attacker.example"})
    assert rebound.status_code == 400 and "attacker.example" in rebound.json()["error"]


def test_a_kept_alive_connection_serves_several_requests(strict):
    # The read deadlines must not cut a client that behaves.
    with connect(strict.port) as sock:
        for _ in range(3):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            assert read_response(sock).status == 200


def test_after_sigterm_new_clients_get_503_while_in_flight_requests_finish(long_model_dir):
    with live_server(long_model_dir, drain_seconds=60) as server:
        result: dict = {}
        body = {"inputs": "Before shutdown", "parameters": {"max_new_tokens": 900, "ignore_eos": True}}

        def call():
            result["response"] = httpx.post(server.url + "/generate", json=body, timeout=WAIT_S)

        caller = threading.Thread(target=call)
        caller.start()
        wait_until(lambda: server.slots_used() == 1, WAIT_S, "the request to start")
        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: server.get("/health").status_code == 503, WAIT_S, "the drain to begin")
        late = httpx.post(server.url + "/generate", json={"inputs": "late"}, timeout=WAIT_S)
        assert late.status_code == 503 and late.json()["error_type"] == "overloaded", late.text
        assert "retry-after" in late.headers
        assert server.get("/metrics").status_code == 200  # the last scrape still works
        caller.join(WAIT_S)
        assert result["response"].status_code == 200
        assert server.process.wait(timeout=WAIT_S) in (0, -signal.SIGTERM)

