"""Nothing heavy runs on the event loop: while clients send ~1 MB texts to tokenize (a ~17 MB
answer each) and to generate from, a token stream that is already running keeps flowing.

The measure is the longest gap between two tokens of the stream, compared with the gaps of the
same stream just before, on the same machine: no absolute timing."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.reliability.results import record
from tests.service.live import WAIT_S, live_server

pytestmark = pytest.mark.slow

BIG_TEXT = ("The quick brown fox jumps over the lazy dog. " * 25_000)[:1_000_000]
HEAVY_CALLS = 3
BASELINE_TOKENS = 60
# Generous: a shared 2-core machine makes every gap noisy, and the heavy calls take CPU from the
# engine on purpose. Measured on 2 cores: ~30x the baseline with the work off the loop, ~450x
# (an 11 s freeze) with it on.
ALLOWED_FACTOR = 100


def token_times(url: str, times: list[float], stop: threading.Event) -> None:
    body = {"inputs": "A long story", "parameters": {"max_new_tokens": 1000, "ignore_eos": True}}
    with httpx.stream("POST", url + "/generate_stream", json=body, timeout=WAIT_S) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                times.append(time.perf_counter())
            if stop.is_set():
                return


# Each heavy call from its own process: reading a 17 MB answer in this one would compete for
# this process' GIL with the thread that timestamps the stream, and measure the client.
# Raw socket, answer read and dropped unparsed: the client must cost the shared CPU little.
HEAVY_CLIENT = """
import socket, sys
port, path, body = int(sys.argv[1]), sys.argv[2], sys.stdin.buffer.read()
sock = socket.create_connection(("127.0.0.1", port), timeout=float(sys.argv[3]))
sock.sendall(b"POST %s HTTP/1.1\\r\\nHost: localhost\\r\\nContent-Type: application/json\\r\\n"
             b"Connection: close\\r\\nContent-Length: %d\\r\\n\\r\\n" % (path.encode(), len(body)) + body)
first = sock.recv(65536)
while sock.recv(1 << 20):
    pass
print(first.split()[1].decode())
"""


def heavy(port: int, path: str, body: dict, statuses: list[int]) -> None:
    done = subprocess.run([sys.executable, "-c", HEAVY_CLIENT, str(port), path, str(WAIT_S * 2)],
                          input=json.dumps(body).encode(), capture_output=True, timeout=WAIT_S * 3)
    statuses.append(int(done.stdout or 0))


@pytest.fixture(scope="module")
def server(long_model_dir):
    with live_server(long_model_dir, max_body_bytes=2_000_000) as running:
        yield running


def test_a_stream_keeps_flowing_while_big_texts_are_tokenized(server):
    times: list[float] = []
    stop = threading.Event()
    streamer = threading.Thread(target=token_times, args=(server.url, times, stop))
    streamer.start()
    deadline = time.monotonic() + WAIT_S
    while len(times) < BASELINE_TOKENS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(times) >= BASELINE_TOKENS, "the stream did not start"
    baseline = statistics.median(b - a for a, b in zip(times, times[1:]))
    heavy_from = len(times)

    statuses: list[int] = []
    calls = [threading.Thread(target=heavy, args=(server.port, "/tokenize", {"inputs": BIG_TEXT}, statuses))
             for _ in range(HEAVY_CALLS)]
    calls.append(threading.Thread(target=heavy, args=(server.port, "/generate", {"inputs": BIG_TEXT}, statuses)))
    started = time.perf_counter()
    for call in calls:
        call.start()
    for call in calls:
        call.join(WAIT_S * 2)
    heavy_s = time.perf_counter() - started
    stop.set()
    streamer.join(WAIT_S)

    during = [t for t in times[heavy_from - 1:] if t <= started + heavy_s]
    worst = max(b - a for a, b in zip(during, during[1:]))
    record("event_loop", {"baseline_gap_s": baseline, "worst_gap_s": worst, "heavy_calls": len(calls),
                          "heavy_s": heavy_s, "tokens_during": len(during)})
    assert sorted(statuses) == [200] * HEAVY_CALLS + [422]  # the 1 MB prompt is longer than the context
    assert len(during) > 2, "no token arrived while the heavy calls ran"
    assert worst < ALLOWED_FACTOR * baseline, f"worst gap {worst:.3f}s vs baseline {baseline:.4f}s"
