"""The official clients, unchanged, against a real server process; a real Prometheus scraping it.

huggingface_hub's InferenceClient (TGI's client) and the `openai` client talk to
`python -m service` on loopback; any attempt of theirs to reach the network fails the test.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import huggingface_hub.constants
import huggingface_hub.errors
import jsonschema
import pytest
from huggingface_hub import InferenceClient
from openai import OpenAI

from tests.service.live import WAIT_S, forbid_network, live_server, wait_until
from tests.processes import free_port

pytestmark = pytest.mark.slow

PROMPT = "The meaning of life is"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with live_server(tiny_model_dir) as running:
        yield running


@pytest.fixture
def hf(server, monkeypatch):
    forbid_network(monkeypatch)
    # HF_HUB_OFFLINE=1 (set in CI) makes the client refuse every request, loopback included; the
    # network stays forbidden by forbid_network, so lifting it here reaches only our server.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return InferenceClient(base_url=server.url, timeout=60)


@pytest.fixture
def oai(server, monkeypatch):
    forbid_network(monkeypatch)
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_hf_text_generation_sends_its_grammar_unchanged(hf):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    text = hf.text_generation(PROMPT, max_new_tokens=20, grammar={"type": "json", "value": schema})
    jsonschema.validate(json.loads(text), schema)
    assert hf.text_generation(PROMPT, max_new_tokens=12, grammar={"type": "regex", "value": "(red|blue)!"}) in ("red!", "blue!")
    # TGI 3's named schema, a type of the client's own enum.
    out = hf.text_generation(PROMPT, max_new_tokens=20, details=True, grammar={"type": "json_schema", "value": {"name": "answer", "schema": schema}})
    assert out.details.finish_reason == "eos_token"
    jsonschema.validate(json.loads(out.generated_text), schema)
    # A grammar llguidance cannot run is refused before any token, its reason the client's error.
    with pytest.raises(huggingface_hub.errors.ValidationError, match="too many expressions"):
        hf.text_generation(PROMPT, max_new_tokens=16, grammar={"type": "regex", "value": "(a{1000}){1000}"})


def test_hf_text_generation_plain_details_and_stream(hf, tokenizer):
    text = hf.text_generation(PROMPT, max_new_tokens=8)
    assert isinstance(text, str) and text

    out = hf.text_generation(PROMPT, max_new_tokens=8, details=True, decoder_input_details=True)
    assert out.generated_text == text  # greedy: the same answer
    assert out.details.generated_tokens == len(out.details.tokens)
    assert out.details.generated_tokens == 8 or out.details.finish_reason == "eos_token"
    assert out.details.finish_reason in ("length", "eos_token")
    assert [t.id for t in out.details.prefill] == tokenizer.encode(PROMPT)
    assert out.details.prefill[0].logprob is None and all(t.logprob < 0 for t in out.details.prefill[1:])

    pieces = list(hf.text_generation(PROMPT, max_new_tokens=8, stream=True))
    assert "".join(pieces) == text

    events = list(hf.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert [e.token.id for e in events] == [t.id for t in out.details.tokens]
    # Most of these events the core reader writes itself (service/http/body_writer.py), numbering them.
    assert [e.index for e in events] == list(range(1, len(events) + 1))
    assert events[-1].generated_text == text
    assert events[-1].details.finish_reason == out.details.finish_reason
    assert events[-1].details.generated_tokens == out.details.generated_tokens


def test_hf_client_raises_its_validation_error(hf):
    from huggingface_hub.errors import ValidationError

    with pytest.raises(ValidationError, match="top_p"):
        hf.text_generation(PROMPT, max_new_tokens=4, top_p=3.0)
    # An adapter not served: one of TGI's error kinds, so the client raises its own class for it.
    with pytest.raises(ValidationError, match="'nope' is not served"):
        hf.text_generation(PROMPT, max_new_tokens=4, adapter_id="nope")


def test_openai_completions_plain_and_stream(oai, hf):
    expected = hf.text_generation(PROMPT, max_new_tokens=6)
    completion = oai.completions.create(model="gpt2", prompt=PROMPT, max_tokens=6, temperature=0)
    assert completion.choices[0].text == expected
    assert completion.usage.completion_tokens == 6 or completion.choices[0].finish_reason == "stop"

    chunks = list(oai.completions.create(model="gpt2", prompt=PROMPT, max_tokens=6, temperature=0, stream=True))
    assert "".join(c.text for chunk in chunks for c in chunk.choices) == expected
    assert chunks[-1].choices[0].finish_reason == completion.choices[0].finish_reason

    assert [m.id for m in oai.models.list()] == ["gpt2"]


def test_openai_client_sees_422_as_unprocessable_and_404_for_a_model_not_served(oai):
    from openai import NotFoundError, UnprocessableEntityError

    with pytest.raises(UnprocessableEntityError) as raised:
        oai.completions.create(model="gpt2", prompt=PROMPT, max_tokens=2, temperature=9.0)
    # OpenAI's error shape on /v1: the client reads the message, type, param and code from it.
    assert raised.value.code == "validation" and raised.value.type == "invalid_request_error"
    assert "temperature" in raised.value.message and raised.value.param == "temperature"
    # As OpenAI answers a model that does not exist (and vLLM an adapter it has not loaded).
    with pytest.raises(NotFoundError) as raised:
        oai.completions.create(model="davinci", prompt=PROMPT, max_tokens=2)
    assert raised.value.code == "model_not_found" and "'davinci' is not served" in raised.value.message


# --- Prometheus --------------------------------------------------------------------------------

PROMETHEUS = shutil.which("prometheus")


def prometheus_value(base: str, query: str) -> float | None:
    try:
        body = httpx.get(f"{base}/api/v1/query", params={"query": query}, timeout=5).json()
    except (httpx.TransportError, ValueError):
        return None
    results = body.get("data", {}).get("result", [])
    return float(results[0]["value"][1]) if results else None


@pytest.fixture
def prometheus(server, tmp_path: Path):
    if PROMETHEUS is None:
        pytest.skip("Debian's prometheus is not installed (make system-deps installs it)")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        f"scrape_configs:\n  - job_name: gpt2\n    static_configs:\n      - targets: ['127.0.0.1:{server.port}']\n"
    )
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: process.poll() is None and prometheus_value(base, "up") == 1.0, WAIT_S, "Prometheus to scrape the server")
        yield base
    finally:
        process.kill()
        process.wait(timeout=30)


def test_prometheus_scrapes_the_generated_token_count(prometheus, server, hf, oai):
    # Prometheus' own view before, once it has caught up with the server.
    current = server.metric("gpt2_generated_tokens_total")
    wait_until(lambda: prometheus_value(prometheus, "gpt2_generated_tokens_total") == current, WAIT_S, "a first scrape")

    reported = hf.text_generation(PROMPT, max_new_tokens=5, details=True).details.generated_tokens
    reported += list(hf.text_generation(PROMPT, max_new_tokens=4, details=True, stream=True))[-1].details.generated_tokens
    reported += oai.completions.create(model="gpt2", prompt=PROMPT, max_tokens=3, temperature=0).usage.completion_tokens
    assert reported > 0

    wait_until(
        lambda: prometheus_value(prometheus, "gpt2_generated_tokens_total") == current + reported,
        WAIT_S, f"Prometheus to report {current + reported} generated tokens",
    )
    # InferenceClient(base_url=...) posts to TGI's "/" route, streaming or not.
    assert prometheus_value(prometheus, 'gpt2_requests_total{endpoint="/",outcome="success"}') >= 2
    assert prometheus_value(prometheus, "gpt2_kv_cache_usage_ratio") == 0.0
