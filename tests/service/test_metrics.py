"""GET /metrics: the contract's families, counters equal to what the responses reported."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service.app import create_app
from tests.conftest import TINY
from tests.service.conftest import settings_for, sse_payloads

FAMILIES = {
    "gpt2_requests": "counter",
    "gpt2_request_duration_seconds": "histogram",
    "gpt2_time_to_first_token_seconds": "histogram",
    "gpt2_inter_token_latency_seconds": "histogram",
    "gpt2_queue_duration_seconds": "histogram",
    "gpt2_prompt_tokens": "counter",
    "gpt2_prompt_tokens_computed": "counter",
    "gpt2_prompt_tokens_cached": "counter",
    "gpt2_decode_sequence_steps": "counter",
    "gpt2_decode_tokens": "counter",
    "gpt2_spec_draft_tokens": "counter",
    "gpt2_spec_accepted_tokens": "counter",
    "gpt2_generated_tokens": "counter",
    "gpt2_requests_running": "gauge",
    "gpt2_requests_waiting": "gauge",
    "gpt2_batch_size": "histogram",
    "gpt2_kv_cache_usage_ratio": "gauge",
    "gpt2_analysis_duration_seconds": "histogram",
    "gpt2_analysis_fast_matrices": "counter",
    "gpt2_constrained_requests": "counter",
    "gpt2_grammar_compile_seconds": "histogram",
    "gpt2_grammar_cache_hits": "counter",
    "gpt2_request_failures": "counter",
    "gpt2_model_info": "gauge",  # Info, as the text format exposes it
}


def scrape(client) -> dict[tuple[str, frozenset], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture(scope="module")
def fresh(tiny_model_dir):
    """An app of its own: the counts below start from zero."""
    with TestClient(create_app(settings_for(tiny_model_dir))) as client:
        yield client


def test_families_and_types(fresh):
    text = fresh.get("/metrics").text
    declared = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert {name: declared.get(name) for name in FAMILIES} == FAMILIES
    samples = scrape(fresh)
    info = next(dict(labels) for (name, labels) in samples if name == "gpt2_model_info")
    assert info["n_layer"] == str(TINY.n_layer) and info["n_embd"] == str(TINY.n_embd)
    assert info["dtype"] == "float32" and info["device"] == "cpu"
    # Every (endpoint, outcome) series exists at zero before any request.
    assert value(samples, "gpt2_requests_total", endpoint="/generate", outcome="overloaded") == 0
    assert value(samples, "gpt2_analysis_fast_matrices_total", result="fallback") == 0


def test_counters_agree_with_responses(fresh, tokenizer):
    before = scrape(fresh)
    generated = prompt_tokens = engine_requests = inter_token_gaps = 0

    out = fresh.post("/generate", json={"inputs": "Counting tokens", "parameters": {"max_new_tokens": 7, "details": True}}).json()
    generated += out["details"]["generated_tokens"]
    prompt_tokens += len(tokenizer.encode("Counting tokens"))
    inter_token_gaps += out["details"]["generated_tokens"] - 1
    engine_requests += 1

    prompts = ["a b c", "one two"]
    outs = fresh.post("/generate", json={"inputs": prompts, "parameters": {"max_new_tokens": 5, "details": True}}).json()
    generated += sum(o["details"]["generated_tokens"] for o in outs)
    prompt_tokens += sum(len(tokenizer.encode(p)) for p in prompts)
    inter_token_gaps += sum(o["details"]["generated_tokens"] - 1 for o in outs)
    engine_requests += 2

    completion = fresh.post("/v1/completions", json={"model": "gpt2", "prompt": "xyz", "max_tokens": 6, "temperature": 0}).json()
    generated += completion["usage"]["completion_tokens"]
    prompt_tokens += completion["usage"]["prompt_tokens"]
    inter_token_gaps += completion["usage"]["completion_tokens"] - 1
    engine_requests += 1

    with fresh.stream("POST", "/generate_stream", json={"inputs": "stream me", "parameters": {"max_new_tokens": 4}}) as r:
        events = sse_payloads(r.iter_lines())
    generated += len(events)
    prompt_tokens += len(tokenizer.encode("stream me"))
    inter_token_gaps += len(events) - 1
    engine_requests += 1

    assert fresh.post("/generate", json={"inputs": ""}).status_code == 422
    assert fresh.post("/generate", json={"inputs": "x", "parameters": {"top_p": 7}}).status_code == 422

    after = scrape(fresh)

    def delta(name, **labels):
        return value(after, name, **labels) - before.get((name, frozenset(labels.items())), 0.0)

    assert delta("gpt2_generated_tokens_total") == generated
    assert delta("gpt2_prompt_tokens_total") == prompt_tokens
    assert delta("gpt2_requests_total", endpoint="/generate", outcome="success") == 2
    assert delta("gpt2_requests_total", endpoint="/generate", outcome="validation") == 2
    assert delta("gpt2_requests_total", endpoint="/v1/completions", outcome="success") == 1
    assert delta("gpt2_requests_total", endpoint="/generate_stream", outcome="success") == 1
    assert delta("gpt2_request_duration_seconds_count", endpoint="/generate") == 4
    assert delta("gpt2_time_to_first_token_seconds_count") == engine_requests
    assert delta("gpt2_queue_duration_seconds_count") == engine_requests
    assert delta("gpt2_inter_token_latency_seconds_count") == inter_token_gaps
    assert delta("gpt2_batch_size_count") >= max(o["details"]["generated_tokens"] for o in outs)
    # Everything finished: nothing holds a slot or waits.
    assert value(after, "gpt2_kv_cache_usage_ratio") == 0
    assert value(after, "gpt2_requests_running") == 0
    assert value(after, "gpt2_requests_waiting") == 0
    # Probes and scrapes are not requests for the model.
    assert not any(dict(labels).get("endpoint") in ("/metrics", "/health") for _, labels in after)


def test_prompt_tokens_split_into_computed_and_cached(fresh, tokenizer):
    text = ("A prompt sent twice, the second time served from the prefix cache, which shares whole blocks"
            " of sixteen tokens: this one is long enough to hold two of them and a few tokens more.")
    before = scrape(fresh)
    for _ in range(2):
        assert fresh.post("/generate", json={"inputs": text, "parameters": {"max_new_tokens": 2}}).status_code == 200
    after = scrape(fresh)

    def delta(name):
        return value(after, name) - value(before, name)

    length = len(tokenizer.encode(text))
    # The second time, the full blocks before the last token (whose logits pick the first new one).
    cached = (length - 1) // 16 * 16
    assert cached >= 32
    assert delta("gpt2_prompt_tokens_cached_total") == cached
    assert delta("gpt2_prefix_cache_hits_total") == cached // 16  # counted in blocks
    assert delta("gpt2_prompt_tokens_computed_total") == 2 * length - cached
    assert delta("gpt2_prompt_tokens_total") == 2 * length


@pytest.fixture(scope="module")
def speculating(tiny_model_dir):
    with TestClient(create_app(settings_for(tiny_model_dir, speculative_ngram=True))) as client:
        yield client


def test_speculation_counts_drafts_and_tokens_per_forward(speculating):
    fresh = speculating
    # The tiny random model's greedy output soon cycles: n-gram drafts of it stand.
    body = {"inputs": "one two three one two three one two three", "parameters": {"max_new_tokens": 40}}
    names = ("gpt2_spec_draft_tokens_total", "gpt2_spec_accepted_tokens_total", "gpt2_decode_sequence_steps_total",
             "gpt2_decode_tokens_total")

    def counts() -> list[float]:
        samples = scrape(fresh)
        return [value(samples, name) for name in names]

    before = counts()
    assert fresh.post("/generate", json=body).status_code == 200
    drafted, accepted, steps, tokens = (a - b for a, b in zip(counts(), before))
    assert 0 < accepted <= drafted
    assert tokens == 39 and steps == tokens - accepted  # the first token came from the prefill
    before = counts()
    off = {**body, "parameters": {**body["parameters"], "speculate": False}}
    assert fresh.post("/generate", json=off).status_code == 200
    drafted, accepted, steps, tokens = (a - b for a, b in zip(counts(), before))
    assert (drafted, accepted, steps, tokens) == (0, 0, 39, 39)


def test_analysis_duration_observed_through_the_app_metrics(fresh):
    metrics = fresh.app.state.service.metrics
    metrics.analysis_duration.observe(0.25)
    assert value(scrape(fresh), "gpt2_analysis_duration_seconds_sum") >= 0.25
