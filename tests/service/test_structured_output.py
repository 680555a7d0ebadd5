"""Structured output over HTTP: TGI's `grammar`, OpenAI's `response_format`, vLLM's
`structured_outputs`; outputs that parse and validate; bad and hostile grammars answered 422 in
bounded time, the server serving on."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from service.http.grammar import MAX_GRAMMAR_CHARS, MAX_OPTIONAL_PROPERTIES, MAX_SCHEMA_DEPTH
from tests.conftest import error_of

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


def ref_loop(*names: str) -> dict:
    defs = {name: {"$ref": f"#/$defs/{names[(i + 1) % len(names)]}"} for i, name in enumerate(names)}
    return {"$ref": f"#/$defs/{names[0]}", "$defs": defs}


def optional_properties(count: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(count)}}


# Issue 43's reproducers: each compiles in milliseconds and then failed on its first masks, in the
# engine core's step loop, its request answered 200 with a truncated text. Refused now (422, the
# reason named) before any token.
FAILING = [
    ({"type": "regex", "value": "(a{1000}){1000}"}, "fails after its first token 'aaaa': lexer error: too many expressions"),
    ({"type": "regex", "value": r"[^\s\S]"}, "matches no text"),
    ({"type": "json", "value": ref_loop("a")}, "matches no text"),
    ({"type": "json", "value": ref_loop("a", "b")}, "matches no text"),
    ({"type": "json", "value": {"$ref": "#/$defs/a", "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}}}},
     "fails after its first token '[[': parser error: Too many items"),
    ({"type": "json", "value": optional_properties(2000)}, f"an object with 2000 optional properties; at most {MAX_OPTIONAL_PROPERTIES}"),
    ({"type": "json_schema", "value": {"name": "loop", "schema": ref_loop("a")}}, "matches no text"),
    ({"type": "regex", "value": "(a){0}"}, "matches only the empty text"),
]


@pytest.mark.parametrize("grammar, reason", FAILING, ids=lambda v: v if isinstance(v, str) else v["type"])
def test_grammars_that_fail_their_first_masks_are_refused_before_any_token(client, grammar, reason):
    body = {"inputs": "Answer:", "parameters": {"max_new_tokens": 16, "details": True, "grammar": grammar}}
    response = client.post("/generate", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"].startswith("grammar") and reason in response.json()["error"], response.json()
    with client.stream("POST", "/generate_stream", json=body) as stream:
        assert stream.status_code == 422
        assert reason in json.loads(stream.read())["error"]


@pytest.mark.parametrize("extra, reason", [
    ({"structured_outputs": {"regex": "(a{1000}){1001}"}}, "too many expressions"),
    ({"structured_outputs": {"grammar": "start: /(a{1000}){1000}/"}}, "too many expressions"),
    ({"structured_outputs": {"json": ref_loop("a", "b")}}, "matches no text"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": ref_loop("a")}}}, "matches no text"),
    ({"structured_outputs": {"regex": r"[^\s\S]"}}, "matches no text"),
])
def test_openai_refuses_them_too(client, extra, reason):
    response = client.post("/v1/completions", json={"model": "gpt2", "prompt": "Answer:", "max_tokens": 16, **extra})
    assert response.status_code == 422, response.text
    assert reason in error_of(response)[1], response.json()


def test_an_object_of_optional_properties_is_served_up_to_its_bound(client):
    schema = {**optional_properties(MAX_OPTIONAL_PROPERTIES), "additionalProperties": False}
    response = tgi(client, {"type": "json", "value": schema}, max_new_tokens=8)
    assert response.status_code == 200, response.text
    response = tgi(client, {"type": "json", "value": optional_properties(MAX_OPTIONAL_PROPERTIES + 1)})
    assert response.status_code == 422 and "optional properties" in response.json()["error"]


def test_tgi_json_schema_grammar(client):
    """TGI 3's `json_schema` type (huggingface_hub's client sends it): a named schema."""
    for seed in range(3):
        response = tgi(client, {"type": "json_schema", "value": {"name": "answer", "schema": SCHEMA}}, do_sample=True, seed=seed)
        assert response.status_code == 200, response.text
        assert response.json()["details"]["finish_reason"] == "eos_token"
        jsonschema.validate(json.loads(response.json()["generated_text"]), SCHEMA)
    for value, named in [("not an object", "json_schema grammar's value"), ({"name": "x", "schema": {}, "extra": 1}, "extra")]:
        response = tgi(client, {"type": "json_schema", "value": value})
        assert response.status_code == 422 and named in response.text, response.text


def test_a_grammar_compiles_off_the_event_loop(client):
    """While one request's grammar compiles (held here), the server answers others: the compile
    and its first masks run on a thread of their own, never on the loop that streams tokens."""
    grammars = client.app.state.service.grammars.grammars
    compiling, release, compiled = threading.Event(), threading.Event(), threading.Event()
    real = grammars.compile

    def held(grammar: str):
        compiling.set()
        release.wait(30)  # on the event loop (the fault this guards against) the plain call waits this out
        compiled.set()
        return real(grammar)

    grammars.compile = held
    try:
        held_call = threading.Thread(target=tgi, args=(client, {"type": "regex", "value": "held-[0-9]"}))
        held_call.start()
        assert compiling.wait(60)
        plain = client.post("/generate", json={"inputs": "Q:", "parameters": {"max_new_tokens": 4}})
        assert plain.status_code == 200 and not compiled.is_set()
    finally:
        release.set()
        grammars.compile = real
        held_call.join(60)
