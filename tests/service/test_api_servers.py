"""--api-servers 2: two HTTP processes on one port in front of one engine core, as clients see it.

Each check pins a connection to a known HTTP process (the kernel spreads connections over the
processes listening with SO_REUSEPORT; /proc tells which one accepted a connection), so "either
process" is tested, not assumed.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
from pathlib import Path

import pytest

from tests.processes import analysis_pids, api_server_pids, connection_owner
from tests.service.live import WAIT_S, live_server, wait_until

pytestmark = pytest.mark.slow

LONG = {"max_new_tokens": 900, "ignore_eos": True}


class Pinned:
    """One kept-alive connection, and the HTTP process that accepted it."""

    def __init__(self, server, pids: list[int]) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
        self.conn.connect()
        self.get("/health")  # accepted and served: its server end is in one process now
        self.pid = connection_owner(pids, self.conn.sock.getsockname()[1])

    def request(self, method: str, path: str, body: dict | None = None) -> http.client.HTTPResponse:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        self.conn.request(method, path, None if body is None else json.dumps(body), headers)
        return self.conn.getresponse()

    def get(self, path: str) -> tuple[int, bytes]:
        response = self.request("GET", path)
        return response.status, response.read()

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        response = self.request("POST", path, body)
        return response.status, json.loads(response.read())

    def metric(self, name: str, **labels: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        status, text = self.get("/metrics")
        assert status == 200
        for family in text_string_to_metric_families(text.decode()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        raise KeyError(name)

    def open_stream(self, inputs: str) -> http.client.HTTPResponse:
        response = self.request("POST", "/generate_stream", {"inputs": inputs, "parameters": LONG})
        assert response.status == 200
        assert first_event(response)["index"] == 1
        return response

    def close(self) -> None:
        self.conn.close()


def first_event(response: http.client.HTTPResponse) -> dict:
    while line := response.readline():
        if line.startswith(b"data:"):
            return json.loads(line[5:])
    raise AssertionError("the stream ended before its first event")


def last_event(response: http.client.HTTPResponse) -> dict:
    events = [json.loads(line[5:]) for line in iter(response.readline, b"") if line.startswith(b"data:")]
    return events[-1]


def pinned_to_each(server, per_process: int = 1, tries: int = 200) -> dict[int, list[Pinned]]:
    """`per_process` connections to every HTTP process of the server."""
    pids = api_server_pids(server.process.pid)
    assert len(pids) == 2, pids
    found: dict[int, list[Pinned]] = {pid: [] for pid in pids}
    for _ in range(tries):
        if all(len(c) >= per_process for c in found.values()):
            return {pid: c[:per_process] for pid, c in found.items()}
        pinned = Pinned(server, pids)
        found[pinned.pid].append(pinned)
    raise AssertionError(f"{tries} connections did not reach every process: {[len(c) for c in found.values()]}")


@pytest.fixture(scope="module")
def server(long_model_dir):
    with live_server(long_model_dir, api_servers=2, max_batch_size=2, max_waiting=2) as running:
        yield running


def test_same_seed_same_tokens_whichever_process(server):
    body = {"inputs": "The same seed", "parameters": {"max_new_tokens": 12, "do_sample": True, "seed": 7,
                                                       "details": True}}
    answers = []
    for (conn,) in pinned_to_each(server).values():
        status, answer = conn.post("/generate", body)
        assert status == 200, answer
        answers.append([t["id"] for t in answer["details"]["tokens"]])
    assert len(answers[0]) == 12 and answers[0] == answers[1]


def test_one_scrape_of_either_process_counts_every_process(server):
    conns = [c for (c,) in pinned_to_each(server).values()]
    generated = [c.metric("gpt2_generated_tokens_total") for c in conns]
    success = [c.metric("gpt2_requests_total", endpoint="/generate", outcome="success") for c in conns]
    assert generated[0] == generated[1] and success[0] == success[1]
    reported = 0
    for conn, tokens in zip(conns, (5, 9)):
        status, answer = conn.post("/generate", {"inputs": "Count me", "parameters": {"max_new_tokens": tokens,
                                                                                      "details": True}})
        assert status == 200
        reported += answer["details"]["generated_tokens"]
    for conn in conns:
        assert conn.metric("gpt2_generated_tokens_total") == generated[0] + reported
        assert conn.metric("gpt2_requests_total", endpoint="/generate", outcome="success") == success[0] + 2


def test_the_engines_step_counters_count_each_step_once(server):
    """Every HTTP process gets every step's stats (for its gauges); the step's counters and
    histograms are the core's, and the scrape sums the processes: counted once, not N times."""
    conns = [c for (c,) in pinned_to_each(server).values()]
    decoded, steps = conns[0].metric("gpt2_decode_tokens_total"), conns[0].metric("gpt2_batch_size_count")
    for conn, tokens in zip(conns, (5, 9)):
        status, _ = conn.post("/generate", {"inputs": "Count my steps", "parameters": {"max_new_tokens": tokens,
                                                                                     "ignore_eos": True}})
        assert status == 200
    for conn in conns:
        # The first token of each comes from its prompt's step; the rest from decode steps, one a step.
        assert conn.metric("gpt2_decode_tokens_total") == decoded + (5 - 1) + (9 - 1)
        assert conn.metric("gpt2_batch_size_count") == steps + 5 + 9


def test_the_queue_limit_holds_for_the_whole_server(server):
    """max_batch_size 2 + max_waiting 2: four requests in flight, two on each process, fill it."""
    pinned = pinned_to_each(server, per_process=3)
    running = [conns[0].open_stream(f"Runner {i}") for i, conns in enumerate(pinned.values())]
    waiting = [conns[1].request("POST", "/generate_stream", {"inputs": "Waiter", "parameters": LONG})
               for conns in pinned.values()]
    assert [r.status for r in running + waiting] == [200] * 4  # the waiting are open, with no token yet
    wait_until(lambda: server.metric("gpt2_requests_waiting") == 2, WAIT_S, "two requests waiting")
    for conns in pinned.values():
        status, answer = conns[2].post("/generate", {"inputs": "one too many", "parameters": {"max_new_tokens": 1}})
        assert status == 429 and answer["error_type"] == "overloaded", answer
    for conns in pinned.values():
        for conn in conns:
            conn.close()
    wait_until(lambda: server.slots_used() == 0, WAIT_S, "every slot to be freed after the clients left")
    status, _ = pinned_to_each(server)[api_server_pids(server.process.pid)[0]][0].post(
        "/generate", {"inputs": "room again", "parameters": {"max_new_tokens": 2}})
    assert status == 200


def test_a_killed_http_process_is_restarted_and_counts_survive(server):
    (conn,) = next(iter(pinned_to_each(server).values()))
    generated = conn.metric("gpt2_generated_tokens_total")
    victim = conn.pid
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: len(set(api_server_pids(server.process.pid)) - {victim}) == 2, WAIT_S,
               "a new HTTP process in place of the killed one")
    wait_until(lambda: _both_serve(server), WAIT_S * 3, "the new process to serve")
    for (conn,) in pinned_to_each(server).values():
        # The dead process's counts are still in the totals: nothing is lost from the view.
        assert conn.metric("gpt2_generated_tokens_total") >= generated
        status, answer = conn.post("/generate", {"inputs": "after", "parameters": {"max_new_tokens": 3}})
        assert status == 200, answer


def test_sigterm_to_one_http_process_restarts_it_and_spares_the_core(server):
    core = server.engine_core_pid()
    (conn,) = next(iter(pinned_to_each(server).values()))
    os.kill(conn.pid, signal.SIGTERM)
    wait_until(lambda: len(set(api_server_pids(server.process.pid)) - {conn.pid}) == 2, WAIT_S,
               "a new HTTP process in place of the stopped one")
    wait_until(lambda: _both_serve(server), WAIT_S * 3, "the new process to serve")
    assert server.engine_core_pid() == core  # the one process's drain did not shut the core down


def _both_serve(server) -> bool:
    try:
        pinned = pinned_to_each(server, tries=40)
    except (AssertionError, OSError):
        return False
    return all(conn.get("/health")[0] == 200 for (conn,) in pinned.values())


def test_either_process_analyses_through_the_one_analysis_process(server):
    [analysis] = analysis_pids(server.process.pid)  # one, for two HTTP processes
    pinned = pinned_to_each(server)
    body = {"text": "Which process answers?", "top_k": 2}
    answers = [conn.post("/analyze/logit-lens", body) for (conn,) in pinned.values()]
    assert [status for status, _ in answers] == [200, 200], answers
    assert answers[0][1] == answers[1][1]
    os.kill(analysis, signal.SIGKILL)
    for (conn,) in pinned.values():
        wait_until(lambda conn=conn: conn.post("/analyze/logit-lens", body)[0] == 503, WAIT_S, "a 503 for /analyze")
        status, answer = conn.post("/analyze/logit-lens", body)
        assert answer["error_type"] == "unavailable" and "analysis process has stopped" in answer["error"], answer
        assert conn.get("/health")[0] == 200  # generation does not need it


def test_a_killed_engine_core_fails_every_process_at_once(server):
    pinned = pinned_to_each(server)
    streams = [conn.open_stream(f"Doomed {i}") for i, (conn,) in enumerate(pinned.values())]
    os.kill(server.engine_core_pid(), signal.SIGKILL)
    for stream in streams:
        last = last_event(stream)
        assert last["error_type"] == "generation" and "engine core" in last["error"], last
    for pid in pinned:
        (conn,) = pinned_to_each(server)[pid]
        assert conn.get("/health")[0] == 503


def test_a_killed_supervisor_leaves_no_http_process_behind(server):
    """(Its core is gone already, killed above; a live core exits by itself when its parent dies.)"""
    workers = api_server_pids(server.process.pid)
    assert len(workers) == 2
    server.process.kill()
    wait_until(lambda: not any(_alive(pid) for pid in workers), WAIT_S, "the HTTP processes to exit")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_drains_every_process(long_model_dir):
    with live_server(long_model_dir, api_servers=2, drain_seconds=60) as server:
        results: dict[int, tuple[int, dict]] = {}
        body = {"inputs": "Before shutdown", "parameters": {"max_new_tokens": 300, "ignore_eos": True, "details": True}}
        pinned = pinned_to_each(server)
        callers = [threading.Thread(target=lambda pid=pid, conn=conn: results.__setitem__(pid, conn.post("/generate", body)))
                   for pid, (conn,) in pinned.items()]
        for caller in callers:
            caller.start()
        wait_until(lambda: server.slots_used() == 2, WAIT_S, "both requests to run")
        server.process.send_signal(signal.SIGTERM)
        for caller in callers:
            caller.join(WAIT_S)
        for pid in pinned:
            status, answer = results[pid]
            assert status == 200 and answer["details"]["generated_tokens"] == 300, answer
        assert server.process.wait(timeout=WAIT_S) == 0
        log = server.log(wait_for_exit=True)
        assert log.count("Application shutdown complete") == 2
