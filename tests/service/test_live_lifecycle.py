"""A real server under the situations a unit test cannot make: clients that leave, a full queue,
bad requests next to good ones, SIGTERM with work in flight."""

from __future__ import annotations

import json
import os
import signal
import threading
from contextlib import ExitStack

import httpx
import pytest

from tests.service.live import WAIT_S, live_server, wait_until

pytestmark = pytest.mark.slow

# Long enough (on the 1024-context tiny model) to still be running while the test acts.
LONG = {"max_new_tokens": 900, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(long_model_dir):
    with live_server(long_model_dir, max_batch_size=2, max_waiting=2, drain_seconds=60) as running:
        yield running


class OpenStream:
    """A streaming response held open; its line iterator is kept, because dropping a
    half-read httpx iterator closes the connection (the server then sees a disconnect)."""

    def __init__(self, stack: ExitStack, client: httpx.Client, inputs: str, details: bool = False) -> None:
        body = {"inputs": inputs, "parameters": {**LONG, "details": details}}
        self.response = stack.enter_context(client.stream("POST", "/generate_stream", json=body))
        self.lines = self.response.iter_lines()

    def first_event(self) -> dict:
        assert self.response.status_code == 200
        for line in self.lines:
            if line.startswith("data:"):
                return json.loads(line[5:])
        raise AssertionError("stream ended before its first event")


def test_disconnected_stream_frees_its_slot(server):
    cancelled = server.metric("gpt2_requests_total", endpoint="/generate_stream", outcome="cancelled")
    generated = server.metric("gpt2_generated_tokens_total")
    with httpx.Client(base_url=server.url, timeout=30) as client, ExitStack() as stack:
        stream = OpenStream(stack, client, "A story that goes on")
        assert stream.first_event()["index"] == 1
        assert server.slots_used() == 1
    # The connection is closed: the engine must drop the request within a step or so.
    wait_until(lambda: server.slots_used() == 0, WAIT_S, "the slot of the abandoned stream to be freed")
    wait_until(lambda: server.metric("gpt2_kv_cache_usage_ratio") == 0.0, WAIT_S, "kv usage 0 in /metrics")
    wait_until(
        lambda: server.metric("gpt2_requests_total", endpoint="/generate_stream", outcome="cancelled") == cancelled + 1,
        WAIT_S, "the stream counted as cancelled",
    )
    # Stopped early: fewer tokens generated than asked for.
    assert server.metric("gpt2_generated_tokens_total") - generated < LONG["max_new_tokens"]


def test_disconnected_plain_request_frees_its_slot(server):
    cancelled = server.metric("gpt2_requests_total", endpoint="/generate", outcome="cancelled")
    done = threading.Event()

    def leave_early():
        # A read timeout makes httpx close the connection while the server is still generating.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/generate", json={"inputs": "Patience", "parameters": LONG}, timeout=httpx.Timeout(30, read=1.0))
        done.set()

    caller = threading.Thread(target=leave_early)
    caller.start()
    wait_until(lambda: server.slots_used() == 1, WAIT_S, "the request to start")
    caller.join(WAIT_S)
    assert done.is_set()
    wait_until(lambda: server.slots_used() == 0, WAIT_S, "the slot of the abandoned request to be freed")
    wait_until(
        lambda: server.metric("gpt2_requests_total", endpoint="/generate", outcome="cancelled") == cancelled + 1,
        WAIT_S, "the request counted as cancelled",
    )


def test_full_queue_gets_429_and_others_carry_on(server):
    with httpx.Client(base_url=server.url, timeout=30) as client, ExitStack() as stack:
        running = [OpenStream(stack, client, f"Runner {i}") for i in range(2)]
        for stream in running:
            stream.first_event()  # both hold a slot now (max_batch_size=2)
        waiting = [OpenStream(stack, client, f"Waiter {i}") for i in range(2)]  # max_waiting=2
        assert [w.response.status_code for w in waiting] == [200, 200]  # queued: open, no token yet

        refused = client.post("/generate", json={"inputs": "one too many", "parameters": {"max_new_tokens": 1}})
        assert refused.status_code == 429
        assert refused.json()["error_type"] == "overloaded"
        assert int(refused.headers["retry-after"]) >= 0
        # Invalid requests are answered at once, whatever the load.
        invalid = client.post("/generate", json={"inputs": "x", "parameters": {"temperature": -1}})
        assert invalid.status_code == 422 and invalid.json()["error_type"] == "validation"
        wait_until(lambda: server.metric("gpt2_requests_waiting") == 2, WAIT_S, "the gauge to show both waiting")
    wait_until(lambda: server.slots_used() == 0, WAIT_S, "every slot to be freed after the clients left")
    assert server.metric("gpt2_requests_total", endpoint="/generate", outcome="overloaded") >= 1


def test_sigterm_drains_in_flight_requests(long_model_dir):
    with live_server(long_model_dir, drain_seconds=60) as server:
        result: dict = {}

        def call():
            body = {"inputs": "Before shutdown", "parameters": {**LONG, "details": True}}
            result["response"] = httpx.post(server.url + "/generate", json=body, timeout=WAIT_S)

        caller = threading.Thread(target=call)
        caller.start()
        wait_until(lambda: server.slots_used() == 1, WAIT_S, "the request to start")
        server.process.send_signal(signal.SIGTERM)
        caller.join(WAIT_S)
        response = result["response"]
        assert response.status_code == 200
        assert response.json()["details"]["generated_tokens"] == LONG["max_new_tokens"]  # finished, not cut
        # uvicorn re-raises the caught SIGTERM after its graceful shutdown.
        assert server.process.wait(timeout=WAIT_S) in (0, -signal.SIGTERM)
        log = server.log(wait_for_exit=True)
        # The server says so when SIGTERM found the response still open: the drain was exercised.
        assert "Draining: new requests get 503" in log
        assert "Application shutdown complete" in log


def test_a_killed_engine_core_fails_open_requests_at_once_and_health_turns_503(long_model_dir):
    with live_server(long_model_dir, max_batch_size=2) as server, ExitStack() as stack:
        client = stack.enter_context(httpx.Client(base_url=server.url, timeout=WAIT_S))
        stream = OpenStream(stack, client, "A story that goes on")
        assert stream.first_event()["index"] == 1
        os.kill(server.engine_core_pid(), signal.SIGKILL)
        # The open stream ends with an error event instead of hanging.
        last = [json.loads(line[5:]) for line in stream.lines if line.startswith("data:")][-1]
        assert last["error_type"] == "generation" and "engine core" in last["error"], last
        wait_until(lambda: server.get("/health").status_code == 503, WAIT_S, "/health to answer 503")
        refused = client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
        assert refused.status_code == 503 and refused.json()["error_type"] == "overloaded", refused.text


def test_stream_open_at_the_drain_deadline_ends_with_a_final_event(default_model_dir):
    """The 124M model takes tens of seconds for 900 tokens on a CPU, far beyond a 2 s drain: the
    engine cancels the request before the server gives up, so the stream still ends properly."""
    with live_server(default_model_dir, drain_seconds=2) as server:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as client, ExitStack() as stack:
            stream = OpenStream(stack, client, "A stream cut by a shutdown", details=True)
            assert stream.first_event()["index"] == 1
            server.process.send_signal(signal.SIGTERM)
            events = [json.loads(line[5:]) for line in stream.lines if line.startswith("data:")]
        final = events[-1]
        assert final["generated_text"] is not None, "the stream ended without its final event"
        assert final["details"]["generated_tokens"] == final["index"] < LONG["max_new_tokens"]
        assert final["details"]["finish_reason"] == "length"  # TGI's reason for a cut-short answer
        assert server.process.wait(timeout=WAIT_S) in (0, -signal.SIGTERM)
