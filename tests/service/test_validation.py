"""Bad input gets a 422 {"error", "error_type": "validation"} naming what is wrong; limits,
body size (413), auth (401); and nothing of it leaks a KV-cache slot."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from tests.conftest import TINY
from tests.conftest import assert_validation_error
from tests.service.conftest import settings_for

LONG_TEXT = "word " * 200  # ~200 tokens: more than TINY's 128-token context

TGI_CASES = [
    # (body, words the message must contain)
    ({"inputs": ""}, ["inputs", "empty"]),
    ({"inputs": []}, ["inputs", "empty"]),
    ({"parameters": {}}, ["inputs", "required"]),
    ({"inputs": 5}, ["inputs"]),
    ({"inputs": "x", "parameters": {"temperature": 0}}, ["temperature", "greater than 0"]),
    ({"inputs": "x", "parameters": {"temperature": -1}}, ["temperature"]),
    ({"inputs": "x", "parameters": {"top_p": 1.5}}, ["top_p"]),
    ({"inputs": "x", "parameters": {"top_p": 0}}, ["top_p"]),
    ({"inputs": "x", "parameters": {"top_k": 0}}, ["top_k"]),
    ({"inputs": "x", "parameters": {"top_k": 60000}}, ["top_k", "50257"]),
    ({"inputs": "x", "parameters": {"repetition_penalty": 0}}, ["repetition_penalty"]),
    ({"inputs": "x", "parameters": {"max_new_tokens": 0}}, ["max_new_tokens"]),
    ({"inputs": "x", "parameters": {"max_new_tokens": 5000}}, ["max_new_tokens", "1024"]),
    ({"inputs": "x", "parameters": {"max_new_tokens": 200}}, ["max_new_tokens", "128-token context"]),
    ({"inputs": LONG_TEXT, "parameters": {"max_new_tokens": 1}}, ["tokens", "128-token context"]),
    ({"inputs": "x", "parameters": {"seed": -1}}, ["seed"]),
    ({"inputs": "x", "parameters": {"num_beams": 2, "do_sample": True}}, ["beam search", "sampling"]),
    ({"inputs": "x", "parameters": {"num_beams": 2, "temperature": 0.7}}, ["beam search", "sampling"]),
    ({"inputs": "x", "parameters": {"num_beams": 2, "num_return_sequences": 3}}, ["num_return_sequences", "num_beams"]),
    ({"inputs": "x", "parameters": {"num_return_sequences": 2}}, ["num_return_sequences", "greedy"]),
    ({"inputs": "x", "parameters": {"num_beams": 9}}, ["num_beams", "at most 4"]),
    ({"inputs": "x", "parameters": {"best_of": 2}}, ["best_of", "sampling"]),
    ({"inputs": "x", "parameters": {"stop": ["a", "b", "c", "d", "e"]}}, ["stop", "at most 4"]),
    ({"inputs": "x", "parameters": {"stop": [""]}}, ["stop", "empty"]),
    ({"inputs": "x", "parameters": {"stop": ["y" * 65]}}, ["stop", "64"]),
    ({"inputs": "x", "parameters": {"watermark": True}}, ["watermark", "not supported"]),
    ({"inputs": "x", "parameters": {"top_n_tokens": 6}}, ["top_n_tokens"]),
    ({"inputs": "x", "parameters": {"frequency_penalty": 0.5}}, ["frequency_penalty", "not supported"]),
    ({"inputs": "x", "parameters": {"no_repeat_ngram_size": 2, "num_beams": 2}}, ["no_repeat_ngram_size", "beam search"]),
    ({"inputs": "x", "parameters": {"stop_token_ids": [50257]}}, ["stop_token_ids", "vocabulary"]),
    ({"inputs": "x", "parameters": {"typical_p": 0}}, ["typical_p"]),
    ({"inputs": "x", "parameters": {"top_n_tokens": 2, "num_beams": 2}}, ["beam search"]),
    ({"inputs": "x", "parameters": {"no_such_option": 1}}, ["no_such_option"]),
    ({"inputs": ["a"] * 17}, ["prompts", "at most 16"]),
]


@pytest.mark.parametrize("body,words", TGI_CASES, ids=[str(i) for i in range(len(TGI_CASES))])
def test_tgi_invalid_422(client, body, words):
    assert_validation_error(client.post("/generate", json=body), *words)


STREAM_CASES = [
    ({"inputs": ["a", "b"]}, ["one prompt"]),
    ({"inputs": "x", "parameters": {"num_beams": 2}}, ["beam search"]),
    ({"inputs": "x", "parameters": {"decoder_input_details": True}}, ["decoder_input_details"]),
    ({"inputs": "x", "parameters": {"do_sample": True, "best_of": 2}}, ["best_of"]),
]


@pytest.mark.parametrize("body,words", STREAM_CASES, ids=[str(i) for i in range(len(STREAM_CASES))])
def test_stream_invalid_422_before_streaming(client, body, words):
    assert_validation_error(client.post("/generate_stream", json=body), *words)


OPENAI_CASES = [
    ({"prompt": ""}, ["prompt", "empty"]),
    ({"prompt": [[]]}, ["prompt", "empty"]),
    ({"prompt": [99999999]}, ["token id", "vocabulary"]),
    ({"prompt": [5, -1]}, ["token ids", "between 0 and"]),
    ({"prompt": []}, ["prompt", "empty list"]),
    ({"prompt": "x", "temperature": 3}, ["temperature"]),
    ({"prompt": "x", "max_tokens": 0}, ["max_tokens=0", "echo"]),
    ({"prompt": "x", "max_tokens": 0, "echo": True, "stream": True}, ["max_tokens=0", "stream"]),
    ({"prompt": "x", "n": 2, "best_of": 1}, ["best_of", "n"]),
    ({"prompt": "x", "logprobs": 6}, ["logprobs"]),
    ({"prompt": "x", "prompt_logprobs": 6}, ["prompt_logprobs"]),
    ({"prompt": "x", "frequency_penalty": 2.5}, ["frequency_penalty"]),
    ({"prompt": "x", "logit_bias": {"50257": 1.0}}, ["logit_bias", "50257", "vocabulary"]),
    ({"prompt": "x", "logit_bias": {"a": 1.0}}, ["logit_bias", "token ids"]),
    ({"prompt": "x", "logit_bias": {"5": 101.0}}, ["logit_bias", "-100 and 100"]),
    ({"prompt": "x", "stop_token_ids": [-1]}, ["stop_token_ids"]),
    ({"prompt": "x", "bad_words_ids": [list(range(9))]}, ["bad_words_ids", "1 to 8"]),
    ({"prompt": "x", "bad_words_ids": [[]]}, ["bad_words_ids"]),
    ({"prompt": "x", "min_p": 1.5}, ["min_p"]),
    ({"prompt": "x", "stream": True, "n": 1, "best_of": 2}, ["best_of", "streamed"]),
    ({"prompt": "x", "stop": ["1", "2", "3", "4", "5"]}, ["stop", "at most 4"]),
    ({"prompt": LONG_TEXT, "max_tokens": 1}, ["128-token context"]),
]


@pytest.mark.parametrize("body,words", OPENAI_CASES, ids=[str(i) for i in range(len(OPENAI_CASES))])
def test_openai_invalid_422(client, body, words):
    assert_validation_error(client.post("/v1/completions", json={"model": "gpt2", **body}), *words)


def test_a_model_not_served_is_404_naming_what_is(client):
    # As OpenAI answers a model that does not exist (and vLLM an adapter it has not loaded).
    response = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    error = response.json()["error"]  # OpenAI's shape, with its code for it
    assert response.status_code == 404 and error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
    assert "'gpt-4' is not served" in error["message"] and "'gpt2'" in error["message"]


def test_malformed_json_is_a_validation_error(client):
    response = client.post("/generate", content=b'{"inputs": ', headers={"content-type": "application/json"})
    assert_validation_error(response)


def test_rejections_hold_no_slot_and_valid_requests_still_work(client):
    for body, _ in TGI_CASES:
        client.post("/generate", json=body)
    assert client.get("/info").json()["kv_cache"]["slots_used"] == 0
    ok = client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_tokenize_offsets(client, tokenizer):
    text = "Hello  wörld 🙂!"
    tokens = client.post("/tokenize", json={"inputs": text}).json()
    assert [t["id"] for t in tokens] == tokenizer.encode(text)
    assert "".join(t["text"] for t in tokens) == text
    assert all(text[t["start"] : t["stop"]] == t["text"] for t in tokens)
    assert_validation_error(client.post("/tokenize", json={"inputs": ""}), "inputs")


def test_info_reports_model_and_limits(client, tiny_model_dir):
    info = client.get("/info").json()
    assert info["config"]["n_layer"] == TINY.n_layer and info["config"]["n_embd"] == TINY.n_embd
    assert info["max_total_tokens"] == TINY.n_positions
    assert info["model_dtype"] == "float32" and info["model_device_type"] == "cpu"
    assert info["weights_origin"]["source"] == "user"  # a test-written folder without ORIGIN.json
    assert info["kv_cache"]["slots_total"] == 4
    assert info["kv_cache"]["prefix_caching"] is True
    assert info["max_prefill_tokens_per_step"] == 256  # the CPU's default
    assert info["speculative_decoding"] == {
        "method": None, "ngram_min": 1, "ngram_max": 3, "tokens": 4, "weight_pass_rows": 16.0  # the CPU's default
    }


def test_body_over_limit_gets_413_before_parsing(tiny_model_dir):
    app = create_app(settings_for(tiny_model_dir, max_body_bytes=2000))
    with TestClient(app) as small:
        big = {"inputs": "y" * 5000}
        response = small.post("/generate", json=big)
        assert response.status_code == 413
        assert response.json()["error_type"] == "payload_too_large"
        assert "2000 bytes" in response.json()["error"]
        # Streamed without a Content-Length: counted as it arrives.
        chunks = (b'{"inputs": "' + b"y" * 1000, b"y" * 1000, b"y" * 1000 + b'"}')
        response = small.post("/generate", content=iter(chunks), headers={"content-type": "application/json"})
        assert response.status_code == 413
        assert small.post("/generate", json={"inputs": "ok", "parameters": {"max_new_tokens": 1}}).status_code == 200


def test_bearer_auth(tiny_model_dir):
    app = create_app(settings_for(tiny_model_dir, api_key="s3cret"))
    with TestClient(app) as locked:
        body = {"inputs": "x", "parameters": {"max_new_tokens": 1}}
        denied = locked.post("/generate", json=body)
        assert denied.status_code == 401 and denied.json()["error_type"] == "authentication"
        assert denied.headers["www-authenticate"] == "Bearer"
        assert locked.post("/generate", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert locked.get("/info").status_code == 401
        assert locked.post("/generate", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        # RFC 9110 §11.1: the scheme is case-insensitive; the token is not.
        for scheme in ("bearer", "BEARER"):
            assert locked.post("/generate", json=body, headers={"Authorization": f"{scheme} s3cret"}).status_code == 200
        assert locked.post("/generate", json=body, headers={"Authorization": "Bearer S3CRET"}).status_code == 401
        assert locked.post("/generate", json=body, headers={"Authorization": "Basic s3cret"}).status_code == 401
        assert locked.get("/health").status_code == 200
        assert locked.get("/metrics").status_code == 200


def test_openapi_documents_every_route(client):
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/generate", "/generate_stream", "/", "/v1/completions", "/v1/models", "/health", "/info",
                 "/tokenize", "/detokenize", "/tokenizer_info", "/metrics", "/analyze/spectrum",
                 "/analyze/attention", "/analyze/logit-lens"):
        assert path in paths, path
    # The bounds are documented, not only enforced.
    top_p = client.get("/openapi.json").json()["components"]["schemas"]["TGIParameters"]["properties"]["top_p"]
    assert {"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0} in top_p["anyOf"]


def test_generation_without_a_running_engine_is_503_not_a_hang(tiny_model_dir):
    # No `with`: the lifespan that starts the engine core never runs.
    client = TestClient(create_app(settings_for(tiny_model_dir)))
    response = client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 1}})
    assert response.status_code == 503
    assert response.json()["error_type"] == "overloaded" and "not running" in response.json()["error"]


def test_prefix_caching_and_the_prefill_budget_are_flags():
    from service.launch import parse_settings

    settings = parse_settings(["--no-prefix-caching", "--max-prefill-tokens", "64"])
    assert settings.prefix_caching is False and settings.max_prefill_tokens == 64
    assert parse_settings([]).prefix_caching is True


def test_speculation_settings_are_flags_and_checked():
    from service.launch import parse_settings

    settings = parse_settings(
        ["--speculative-ngram", "--speculative-ngram-min", "2", "--speculative-ngram-max", "4", "--speculative-tokens", "6"]
    )
    assert settings.speculation.min_n == 2 and settings.speculation.max_n == 4 and settings.speculation.tokens == 6
    assert parse_settings(["--no-speculative-ngram"]).speculation is None
    assert parse_settings([]).speculation is None and parse_settings(["--speculative-ngram"]).speculation is not None
    # Draft tokens are priced by the device's rows per weight pass unless the flag says otherwise.
    assert parse_settings(["--speculative-ngram"]).speculation.weight_pass_rows == 16.0
    assert parse_settings(["--speculative-ngram", "--device", "cuda"]).speculation.weight_pass_rows == 200.0
    flagged = parse_settings(["--speculative-ngram", "--speculative-weight-pass-rows", "40"])
    assert flagged.speculation.weight_pass_rows == 40.0
    with pytest.raises(SystemExit):
        parse_settings(["--speculative-weight-pass-rows", "0"])
    with pytest.raises(SystemExit):
        parse_settings(["--speculative-ngram-min", "5", "--speculative-ngram-max", "2"])
