"""A fault of the HTTP side's own work for one request (making its text: the tokenizer's decoder,
its stop strings) ends that request with a 500 of its own, whole or streamed; the server goes on
serving the next."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from service.http.outputs import OutputProcessor, TextStream
from tests.conftest import error_of
from tests.service.conftest import sse_payloads

BOOM = "<boom>"  # the stop string that marks the request whose text fails


def answer(client, body: dict):
    """POST /generate, failing (not hanging) when no answer comes."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(client.post, "/generate", json=body).result(timeout=120)
    finally:
        pool.shutdown(wait=False)


def test_a_request_whose_text_fails_gets_its_own_500(client, monkeypatch):
    add = TextStream.add

    def adding(self, token_id):
        if BOOM in self._stop:
            raise RuntimeError("injected decoder failure")
        return add(self, token_id)
    monkeypatch.setattr(TextStream, "add", adding)
    body = {"inputs": "Hello there", "parameters": {"max_new_tokens": 8, "stop": [BOOM]}}
    response = answer(client, body)  # without the fault's isolation it never got one
    assert response.status_code == 500, response.text
    kind, message = error_of(response)
    assert kind == "generation" and "injected decoder failure" in message
    with client.stream("POST", "/generate_stream", json=body) as streamed:
        assert streamed.status_code == 200
        events = sse_payloads(streamed.iter_lines())
    assert "injected decoder failure" in events[-1]["error"]
    fine = client.post("/generate", json={"inputs": "Hello there", "parameters": {"max_new_tokens": 8, "details": True,
                                                                                   "ignore_eos": True}})
    assert fine.status_code == 200 and fine.json()["details"]["generated_tokens"] == 8
    metrics = client.get("/metrics").text
    counted = [line for line in metrics.splitlines() if line.startswith('gpt2_request_failures_total{cause="output"}')]
    assert counted and float(counted[0].split()[-1]) >= 2


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_step_whose_handling_raises_fails_its_requests_not_leaves_them_waiting(client, monkeypatch, when):
    """Handling a step's output raises where no request is to blame (here: the processor as a
    whole, once): that step's requests fail with a 500 at once and are stopped in the core; the
    next request is served. "after": the processor had already finished the request (its result
    made, not yet queued) when handling raised."""
    process, raised = OutputProcessor.process, []

    def processing(self, step):
        if not step.tokens.request_ids or raised:
            return process(self, step)
        raised.append(True)
        if when == "after":
            process(self, step)
        raise RuntimeError("injected step failure")
    monkeypatch.setattr(OutputProcessor, "process", processing)
    # "before": the request is still running in the core, which the failure must stop; "after":
    # one token, so the step that raises is the one that finishes it.
    response = answer(client, {"inputs": "Hello there", "parameters": {"max_new_tokens": 8 if when == "before" else 1}})
    assert raised and response.status_code == 500, response.text
    assert "injected step failure" in error_of(response)[1]
    fine = answer(client, {"inputs": "Hello there", "parameters": {"max_new_tokens": 8, "details": True, "ignore_eos": True}})
    assert fine.status_code == 200 and fine.json()["details"]["generated_tokens"] == 8
