"""/analyze/attention and /analyze/logit-lens against transformers (eager attention, hidden
states) on the same folder; their bounds (tokens, layers, concurrency) answered 422 / 429."""

from __future__ import annotations

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TINY, assert_validation_error

TEXT = "Attention is all you need, they said."
# float32 probabilities / log-probabilities of the same arithmetic in two implementations.
TOLERANCE = 1e-4


def test_attention_equals_transformers(client, reference, tokenizer):
    response = client.post("/analyze/attention", json={"text": TEXT, "layers": [0, 2]})
    assert response.status_code == 200, response.text
    out = response.json()
    ids = tokenizer.encode(TEXT)
    assert out["token_ids"] == ids and out["tokens"] == [tokenizer.decode([t]) for t in ids]
    with torch.no_grad():
        expected = reference(torch.tensor([ids]), output_attentions=True).attentions  # per layer [1, H, T, T]
    assert [entry["layer"] for entry in out["layers"]] == [0, 2]
    for entry in out["layers"]:
        got = torch.tensor(entry["attention"])  # [H, T, T]
        assert got.shape == (TINY.n_head, len(ids), len(ids))
        torch.testing.assert_close(got, expected[entry["layer"]][0], atol=TOLERANCE, rtol=0)


def test_attention_heatmap_svg(client):
    response = client.post("/analyze/attention", json={"text": TEXT, "layers": [1], "format": "svg"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("image/svg+xml")
    assert response.text.lstrip().startswith("<?xml") and "L1 H3" in response.text


def test_logit_lens_equals_transformers(client, reference, tokenizer):
    response = client.post("/analyze/logit-lens", json={"text": TEXT, "top_k": 3})
    assert response.status_code == 200, response.text
    out = response.json()
    ids = tokenizer.encode(TEXT)
    with torch.no_grad():
        hf = reference(torch.tensor([ids]), output_hidden_states=True)
        hidden = hf.hidden_states  # embeddings, blocks 1..L-1, then ln_f(block L): transformers' layout
        lens = [reference.lm_head(reference.transformer.ln_f(h[0])) for h in hidden[:-1]] + [hf.logits[0]]
    assert len(out["layers"]) == TINY.n_layer + 1
    for depth, entry in enumerate(out["layers"]):
        logprobs = lens[depth].log_softmax(-1)  # [T, V]
        for position, top in enumerate(entry["top"]):
            values, top_ids = logprobs[position].topk(3)
            assert [t["id"] for t in top] == top_ids.tolist()
            assert [t["logprob"] for t in top] == pytest.approx(values.tolist(), abs=TOLERANCE)


@pytest.mark.parametrize(
    "path, body, words",
    [
        ("/analyze/attention", {"text": "x", "layers": [TINY.n_layer]}, ["layers"]),
        ("/analyze/attention", {"text": "x", "token_ids": [1]}, ["exactly one"]),
        ("/analyze/attention", {"token_ids": [1] * 65}, ["65 tokens", "at most 64"]),
        ("/analyze/logit-lens", {"token_ids": [TINY.vocab_size]}, ["vocabulary"]),
        ("/analyze/logit-lens", {"text": "x", "top_k": 11}, ["top_k"]),
    ],
)
def test_bad_inspection_requests_are_422(client, path, body, words):
    assert_validation_error(client.post(path, json=body), *words)


def test_inspection_shares_the_analysis_gate(client):
    client.post("/analyze/logit-lens", json={"text": "x"})  # the gate is made on first use
    gate = client.app.state.analysis_gate
    assert gate.acquire(blocking=False)  # one analysis "running" (the test client's limit is 1)
    try:
        response = client.post("/analyze/attention", json={"text": TEXT})
        assert response.status_code == 429 and response.json()["error_type"] == "overloaded"
    finally:
        gate.release()


def analysis_durations(client) -> float:
    families = text_string_to_metric_families(client.get("/metrics").text)
    return next(s.value for f in families for s in f.samples if s.name == "gpt2_analysis_duration_seconds_count")


@pytest.mark.parametrize("path, body", [
    ("/analyze/attention", {"text": TEXT, "layers": [0]}),
    ("/analyze/logit-lens", {"text": TEXT}),
])
def test_inspection_records_the_analysis_duration(client, path, body):
    # gpt2_analysis_duration_seconds counts every /analyze/* request's work, not only /analyze/spectrum's.
    before = analysis_durations(client)
    assert client.post(path, json=body).status_code == 200
    assert analysis_durations(client) == before + 1
