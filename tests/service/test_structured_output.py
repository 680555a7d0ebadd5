"""Structured output over HTTP: TGI's `grammar`, OpenAI's `response_format`, vLLM's
`structured_outputs`; outputs that parse and validate; bad and hostile grammars answered 422 in
bounded time, the server serving on."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from service.http.grammar import MAX_GRAMMAR_CHARS, MAX_SCHEMA_DEPTH

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer", "n"], "additionalProperties": False}


def tgi(client, grammar: dict, **parameters):
    body = {"inputs": "Q: is it?", "parameters": {"max_new_tokens": 60, "grammar": grammar, "details": True, **parameters}}
    # json.dumps' ASCII escapes: a lone surrogate goes over the wire as JSON allows it (\ud800).
    return client.post("/generate", content=json.dumps(body), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("value", [SCHEMA, json.dumps(SCHEMA)])
def test_tgi_json_grammar_gives_valid_json(client, value):
    for seed in range(4):
        response = tgi(client, {"type": "json", "value": value}, do_sample=True, seed=seed)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["details"]["finish_reason"] == "eos_token"
        jsonschema.validate(json.loads(body["generated_text"]), SCHEMA)


def test_alternatives_are_the_tokens_the_grammar_allows(client, tokenizer):
    # Where the grammar allows one or two tokens, fewer alternatives than asked come back: none
    # with the -inf a forbidden token has (which JSON cannot even carry).
    response = tgi(client, {"type": "json", "value": SCHEMA}, top_n_tokens=3, decoder_input_details=False)
    assert response.status_code == 200, response.text
    details = response.json()["details"]
    assert all(len(top) >= 1 for top in details["top_tokens"])
    assert any(len(top) < 3 for top in details["top_tokens"])  # `{"` and `answer` are forced
    for token, top in zip(details["tokens"], details["top_tokens"]):
        assert all(alt["logprob"] > -1e30 for alt in top)
        assert token["id"] in {alt["id"] for alt in top} or token["logprob"] <= min(alt["logprob"] for alt in top)
    with client.stream("POST", "/generate_stream", json={"inputs": "Q:", "parameters": {
            "max_new_tokens": 40, "top_n_tokens": 3, "grammar": {"type": "json", "value": SCHEMA}}}) as stream:
        events = [json.loads(line[5:]) for line in stream.iter_lines() if line.startswith("data:")]
    jsonschema.validate(json.loads(events[-1]["generated_text"]), SCHEMA)


def test_tgi_regex_grammar_matches(client):
    response = tgi(client, {"type": "regex", "value": r"[A-Z][a-z]{2,5}\."}, do_sample=True, seed=3)
    assert response.status_code == 200, response.text
    assert re.fullmatch(r"[A-Z][a-z]{2,5}\.", response.json()["generated_text"])


def test_tgi_streams_a_constrained_answer(client):
    body = {"inputs": "Q:", "parameters": {"max_new_tokens": 60, "grammar": {"type": "json", "value": SCHEMA}}}
    with client.stream("POST", "/generate_stream", json=body) as response:
        events = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]
    jsonschema.validate(json.loads(events[-1]["generated_text"]), SCHEMA)


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
    {"structured_outputs": {"json": SCHEMA}},
])
def test_openai_json_schema_forms(client, extra):
    body = {"model": "gpt2", "prompt": "Q:", "max_tokens": 60, "temperature": 0.9, "seed": 1, **extra}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    jsonschema.validate(json.loads(response.json()["choices"][0]["text"]), SCHEMA)


def test_openai_json_object_choice_regex_and_grammar(client):
    def choice(extra: dict, max_tokens: int = 40) -> dict:
        body = {"model": "gpt2", "prompt": "Q:", "max_tokens": max_tokens, "temperature": 0.8, "seed": 2, **extra}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    assert choice({"structured_outputs": {"choice": ["red", "green", "blue"]}})["text"] in ("red", "green", "blue")
    assert re.fullmatch(r"\d{3}-\d{2}", choice({"structured_outputs": {"regex": r"\d{3}-\d{2}"}})["text"])
    lark = 'start: "x" ("y" | "z") ("y" | "z") "."'
    assert re.fullmatch(r"x[yz]{2}\.", choice({"structured_outputs": {"grammar": lark}})["text"])
    # Any JSON object: an untrained model may still be inside a string when max_tokens ends it.
    answer = choice({"response_format": {"type": "json_object"}}, 100)
    assert answer["text"].startswith("{")
    if answer["finish_reason"] == "stop":
        assert isinstance(json.loads(answer["text"]), dict)


def test_the_openai_client_sends_response_format_unchanged(client):
    from openai import OpenAI

    openai = OpenAI(base_url=f"{client.base_url}/v1", api_key="x", http_client=client)
    completion = openai.completions.create(
        model="gpt2", prompt="Q:", max_tokens=60, temperature=0.7, seed=4,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)


def nested(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("grammar, named", [
    ({"type": "json", "value": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "grammar"),
    ({"type": "json", "value": "{not json"}, "not JSON"),
    ({"type": "json", "value": nested(MAX_SCHEMA_DEPTH + 5)}, "nests deeper"),
    ({"type": "json", "value": {"type": "object", "description": "x" * (MAX_GRAMMAR_CHARS + 1)}}, "characters"),
    ({"type": "regex", "value": "(unclosed"}, "grammar"),
    ({"type": "regex", "value": {"not": "a string"}}, "string"),
    ({"type": "xml", "value": "<a/>"}, "grammar"),
    ({"type": "regex", "value": "a\ud800"}, "grammar"),  # a lone surrogate (no UTF-8 for it)
    ({"type": "json", "value": {"type": "object", "properties": {"\ud800": {"type": "integer"}}}}, "grammar"),
])
def test_bad_and_hostile_grammars_are_refused_quickly(client, grammar, named):
    start = time.monotonic()
    response = tgi(client, grammar)
    assert response.status_code == 422, response.text
    assert named in response.json()["error"]
    assert time.monotonic() - start < 5
    assert tgi(client, {"type": "json", "value": SCHEMA}).status_code == 200  # and the server serves on


@pytest.mark.parametrize("parameters, named", [
    ({"num_beams": 2}, "beam search"),
    ({"ignore_eos": True}, "ignore_eos"),
])
def test_combinations_a_grammar_refuses(client, parameters, named):
    response = tgi(client, {"type": "json", "value": SCHEMA}, **parameters)
    assert response.status_code == 422, response.text
    assert named in response.json()["error"]


def test_info_names_the_grammar_engine(client):
    grammar = client.get("/info").json()["grammar"]
    assert grammar["engine"].startswith("llguidance ") and set(grammar["kinds"]) == {"json", "regex", "choice", "grammar"}


def test_metrics_count_constrained_requests_and_cache_hits(client):
    def value(name: str) -> float:
        text = client.get("/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    schema = {"type": "object", "properties": {"k": {"enum": ["only-here"]}}, "required": ["k"]}
    before_json, before_hits = value('gpt2_constrained_requests_total{kind="json"}'), value("gpt2_grammar_cache_hits_total")
    compiles = value("gpt2_grammar_compile_seconds_count")
    for _ in range(2):
        assert tgi(client, {"type": "json", "value": schema}).status_code == 200
    assert value('gpt2_constrained_requests_total{kind="json"}') == before_json + 2
    assert value("gpt2_grammar_cache_hits_total") == before_hits + 1  # the second was compiled already
    assert value("gpt2_grammar_compile_seconds_count") == compiles + 1
