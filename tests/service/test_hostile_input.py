"""Inputs a hostile or careless client sends: each gets the service's 422 naming what is wrong,
never a 500 and never a silently different request."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import assert_validation_error, error_of

LONE_SURROGATE = "\ud800"  # valid JSON ("\ud800"), a str to Python, not encodable text

# Every route that takes text, with a body carrying the surrogate where the text goes.
TEXT_ROUTES = [
    ("/generate", lambda t: {"inputs": t, "parameters": {"max_new_tokens": 1}}),
    ("/generate_stream", lambda t: {"inputs": t, "parameters": {"max_new_tokens": 1}}),
    ("/", lambda t: {"inputs": t, "parameters": {"max_new_tokens": 1}}),
    ("/generate", lambda t: {"inputs": ["fine", t], "parameters": {"max_new_tokens": 1}}),
    ("/generate", lambda t: {"inputs": "fine", "parameters": {"max_new_tokens": 1, "stop": [t]}}),
    ("/v1/completions", lambda t: {"model": "gpt2", "prompt": t, "max_tokens": 1}),
    ("/v1/completions", lambda t: {"model": "gpt2", "prompt": "fine", "max_tokens": 1, "stop": t}),
    ("/analyze/spectrum", lambda t: {"texts": [t]}),
    ("/tokenize", lambda t: {"inputs": "fine" + t}),
]


@pytest.mark.parametrize(("path", "body"), TEXT_ROUTES)
def test_a_lone_surrogate_is_a_validation_error(client, path, body):
    # json.dumps escapes it as the six characters \ud800, as a hostile client would send it.
    raw = json.dumps(body(LONE_SURROGATE))
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert_validation_error(response)
    assert "unicode" in error_of(response)[1].lower()


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": "3"}}, "max_new_tokens"),
        ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": True}}, "max_new_tokens"),
        ("/generate", {"inputs": "x", "parameters": {"details": 1}}, "details"),
        ("/generate", {"inputs": "x", "parameters": {"details": "true"}}, "details"),
        ("/generate", {"inputs": "x", "parameters": {"temperature": "0.5"}}, "temperature"),
        ("/generate", {"inputs": "x", "stream": "false"}, "stream"),
        ("/v1/completions", {"model": "gpt2", "prompt": "x", "max_tokens": "3"}, "max_tokens"),
        ("/v1/completions", {"model": "gpt2", "prompt": "x", "echo": 1}, "echo"),
        ("/v1/completions", {"model": "gpt2", "prompt": [True]}, "prompt"),
        ("/v1/completions", {"model": "gpt2", "prompt": [[1, False]]}, "prompt"),
        ("/tokenize", {"inputs": 5}, "inputs"),
        ("/analyze/spectrum", {"token_ids": [[1, True]]}, "token_ids"),
    ],
)
def test_numbers_and_booleans_are_not_coerced(client, path, body, field):
    assert_validation_error(client.post(path, json=body), field)


def test_integral_floats_and_ints_where_a_number_is_expected_still_pass(client):
    ok = client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 1, "temperature": 1}})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    ("path", "body", "key"),
    [
        ("/generate", {"inputs": "x", "paramters": {"max_new_tokens": 1}}, "paramters"),
        ("/generate", {"inputs": "x", "parameters": {"max_tokens": 1}}, "max_tokens"),
        ("/v1/completions", {"model": "gpt2", "prompt": "x", "max_new_tokens": 1}, "max_new_tokens"),
        ("/tokenize", {"inputs": "x", "truncate": 3}, "truncate"),
    ],
)
def test_unknown_keys_are_refused_at_every_level_by_name(client, path, body, key):
    assert_validation_error(client.post(path, json=body), "unsupported parameter", key)


def test_unknown_keys_sent_as_null_are_tolerated_at_every_level(client):
    body = {"inputs": "x", "future_key": None, "parameters": {"max_new_tokens": 1, "other_future_key": None}}
    assert client.post("/generate", json=body).status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 2, "temperature": 1e-50}}),
        ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 2, "temperature": 1e-40, "do_sample": True}}),
        ("/v1/completions", {"model": "gpt2", "prompt": "x", "max_tokens": 2, "temperature": 1e-50}),
        ("/v1/completions", {"model": "gpt2", "prompt": "x", "max_tokens": 2, "temperature": 1e-40}),
    ],
)
def test_temperatures_that_underflow_are_refused(client, path, body):
    assert_validation_error(client.post(path, json=body), "temperature", "greedy")


def test_the_smallest_temperature_allowed_gives_finite_probabilities(client):
    from service.http.schemas import MIN_TEMPERATURE

    body = {"inputs": "Hello there", "parameters": {"max_new_tokens": 4, "temperature": MIN_TEMPERATURE,
                                                    "details": True, "seed": 1}}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    tokens = response.json()["details"]["tokens"]
    assert all(math.isfinite(t["logprob"]) for t in tokens), tokens
    # Near-zero temperature samples the greedy answer.
    greedy = client.post("/generate", json={"inputs": "Hello there", "parameters": {"max_new_tokens": 4, "details": True}})
    assert [t["id"] for t in tokens] == [t["id"] for t in greedy.json()["details"]["tokens"]]


def test_openai_temperature_zero_is_still_greedy(client):
    response = client.post("/v1/completions", json={"model": "gpt2", "prompt": "x", "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
