"""A fault of the HTTP side's own work for one request (making its text: the tokenizer's decoder,
its stop strings) ends that request with a 500 of its own, whole or streamed; the server goes on
serving the next."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from service.http.outputs import TextStream
from tests.conftest import error_of
from tests.service.conftest import sse_payloads

BOOM = "<boom>"  # the stop string that marks the request whose text fails


def test_a_request_whose_text_fails_gets_its_own_500(client, monkeypatch):
    add = TextStream.add

    def adding(self, token_id):
        if BOOM in self._stop:
            raise RuntimeError("injected decoder failure")
        return add(self, token_id)
    monkeypatch.setattr(TextStream, "add", adding)
    body = {"inputs": "Hello there", "parameters": {"max_new_tokens": 8, "stop": [BOOM]}}
    pool = ThreadPoolExecutor(1)  # without the fault's isolation the request never got an answer
    try:
        response = pool.submit(client.post, "/generate", json=body).result(timeout=120)
    finally:
        pool.shutdown(wait=False)
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
