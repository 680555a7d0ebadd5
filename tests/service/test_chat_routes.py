"""POST /v1/chat/completions in-process: the rendered conversation through /v1/completions'
path (the same tokens, the same usage), the chat shapes, tool calls through the grammar
engine, and OpenAI's error shape on /v1."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.http.chat_template import ChatTemplate, special_tokens
from tests.conftest import assert_validation_error, error_of
from tests.service.conftest import settings_for, sse_payloads

TEMPLATES = Path(__file__).parent / "chat_templates"
CHATML = TEMPLATES / "chatml.jinja"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon a time"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "the time", "parameters": TIME}}]


@pytest.fixture(scope="module")
def chat(tiny_model_dir):
    with TestClient(create_app(settings_for(tiny_model_dir, chat_template=str(CHATML)))) as test_client:
        yield test_client


def post_chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": "gpt2", "messages": MESSAGES, **body})


def chat_ok(client, **body) -> dict:
    response = post_chat(client, **body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_chat(client, **body) -> list:
    with client.stream("POST", "/v1/chat/completions", json={"model": "gpt2", "messages": MESSAGES, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        return sse_payloads(r.iter_lines())


def rendered_ids(tiny_model_dir, tokenizer, messages=MESSAGES, **kwargs) -> list[int]:
    text = ChatTemplate(CHATML.read_text(), special_tokens(tiny_model_dir), "chatml").render(messages, **kwargs)
    return tokenizer.encode(text)


def test_a_chat_is_the_completion_of_its_rendered_prompt(chat, tiny_model_dir, tokenizer):
    ids = rendered_ids(tiny_model_dir, tokenizer)
    completion = chat.post("/v1/completions", json={"model": "gpt2", "prompt": ids, "max_tokens": 8, "temperature": 0}).json()
    out = chat_ok(chat, max_tokens=8, temperature=0)
    (choice,) = out["choices"]
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-") and out["model"] == "gpt2"
    assert choice["message"] == {"role": "assistant", "content": completion["choices"][0]["text"], "tool_calls": []}
    assert choice["finish_reason"] == completion["choices"][0]["finish_reason"]
    assert out["usage"] == completion["usage"] and out["usage"]["prompt_tokens"] == len(ids)
    # max_completion_tokens is max_tokens' newer name; text parts are the text they join
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Once upon"}, {"type": "text", "text": "a time"}]}]
    joined = [MESSAGES[0], {"role": "user", "content": "Once upon\na time"}]
    assert chat_ok(chat, messages=parts, max_completion_tokens=8, temperature=0)["choices"] == \
        chat_ok(chat, messages=joined, max_tokens=8, temperature=0)["choices"]


def test_sampled_choices_equal_the_completions_with_the_same_seed(chat, tiny_model_dir, tokenizer):
    ids = rendered_ids(tiny_model_dir, tokenizer)
    body = {"max_tokens": 6, "temperature": 0.9, "top_k": 50, "n": 2, "seed": 7, "presence_penalty": 0.5,
            "logit_bias": {"11": -100}, "stop": ["\n\n"]}
    completion = chat.post("/v1/completions", json={"model": "gpt2", "prompt": ids, **body}).json()
    out = chat_ok(chat, **body)
    assert [c["message"]["content"] for c in out["choices"]] == [c["text"] for c in completion["choices"]]
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"] == completion["usage"]


def test_logprobs_in_the_chat_shape(chat, tiny_model_dir, tokenizer):
    ids = rendered_ids(tiny_model_dir, tokenizer)
    completion = chat.post("/v1/completions", json={"model": "gpt2", "prompt": ids, "max_tokens": 4, "temperature": 0,
                                                     "logprobs": 2}).json()["choices"][0]["logprobs"]
    content = chat_ok(chat, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == completion["tokens"]
    assert [e["logprob"] for e in content] == completion["token_logprobs"]
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    for entry, top in zip(content, completion["top_logprobs"]):
        assert len(entry["top_logprobs"]) == 2
        assert {a["token"]: a["logprob"] for a in entry["top_logprobs"]}.items() <= top.items()
    assert chat_ok(chat, max_tokens=2, temperature=0)["choices"][0]["logprobs"] is None


def test_stream_deltas_make_the_whole_answer_with_usage(chat):
    whole = chat_ok(chat, max_tokens=8, temperature=0)
    events = stream_chat(chat, max_tokens=8, temperature=0, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks) and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[1:-1])
    assert text == whole["choices"][0]["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:-1] if c["choices"][0]["finish_reason"]] == \
        [whole["choices"][0]["finish_reason"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(chat, route):
    body = {"model": "gpt2", "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"messages": MESSAGES} if "chat" in route else {"prompt": "Once upon a time", "echo": True})
    with chat.stream("POST", route, json=body) as response:
        chunks = [c for c in sse_payloads(response.iter_lines()) if c != "[DONE]"]
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"] for c in chunks)


def test_response_format_json_schema_is_followed(chat):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["answer", "n"], "additionalProperties": False}
    out = chat_ok(chat, max_tokens=40, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), schema)
    free = chat_ok(chat, max_tokens=40, response_format={"type": "json_object"}, seed=1)["choices"][0]
    # Any object: an untrained model may not close it within max_tokens.
    assert free["message"]["content"].startswith("{")
    if free["finish_reason"] == "stop":
        assert isinstance(json.loads(free["message"]["content"]), dict)


def test_a_named_tool_choice_answers_a_call_with_valid_arguments(chat):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = chat_ok(chat, max_tokens=40, tools=TOOLS, tool_choice=choice, seed=3)
    (message_choice,) = out["choices"]
    message = message_choice["message"]
    assert message["content"] is None and message_choice["finish_reason"] == "stop"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    # streamed: a first delta opening the call, then its arguments in pieces
    chunks = [c for c in stream_chat(chat, max_tokens=40, tools=TOOLS, tool_choice=choice, seed=3) if c != "[DONE]"]
    opening = chunks[0]["choices"][0]["delta"]["tool_calls"][0]
    assert opening["function"] == {"name": "get_weather", "arguments": ""} and opening["index"] == 0
    pieces = "".join(c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                     for c in chunks[1:] if c["choices"][0]["delta"].get("tool_calls"))
    assert pieces == call["function"]["arguments"]


def test_required_chooses_among_the_tools(chat):
    for seed in range(3):
        out = chat_ok(chat, max_tokens=60, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        schema = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    chunks = [c for c in stream_chat(chat, max_tokens=60, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                     seed=0) if c != "[DONE]"]
    (final,) = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    assert final["finish_reason"] == "tool_calls"
    assert final["delta"]["tool_calls"][0]["function"]["name"] in ("get_weather", "get_time")


def test_tool_choice_auto_is_refused_and_none_answers_text(chat):
    for choice in (None, "auto"):
        response = post_chat(chat, max_tokens=4, tools=TOOLS, **({} if choice is None else {"tool_choice": choice}))
        assert response.status_code == 400
        assert "parser" in error_of(response)[1] and "required" in error_of(response)[1]
    out = chat_ok(chat, max_tokens=4, temperature=0, tools=TOOLS, tool_choice="none")
    assert isinstance(out["choices"][0]["message"]["content"], str) and out["choices"][0]["message"]["tool_calls"] == []


def test_template_options_reach_the_template(tiny_model_dir):
    template = "{{ greeting }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}" \
               "{% if add_generation_prompt %}[assistant]{% endif %}"
    with TestClient(create_app(settings_for(tiny_model_dir, chat_template=template))) as client:
        def prompt_tokens(**body) -> int:
            return chat_ok(client, max_tokens=1, **body)["usage"]["prompt_tokens"]

        plain = prompt_tokens()
        assert prompt_tokens(chat_template_kwargs={"greeting": "Hail, good friend. "}) > plain
        assert prompt_tokens(add_generation_prompt=False) < plain
        continued = MESSAGES + [{"role": "assistant", "content": "And then"}]
        out = chat_ok(client, messages=continued, continue_final_message=True, add_generation_prompt=False, max_tokens=1)
        assert out["usage"]["prompt_tokens"] > plain


def test_no_template_is_a_400_naming_it_and_the_option(client):
    response = post_chat(client, max_tokens=2)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "template_error" and error["type"] == "invalid_request_error"
    assert "chat template" in error["message"] and "--chat-template" in error["message"]


def test_a_template_that_raises_is_a_400_with_its_message(tiny_model_dir):
    template = (TEMPLATES / "llama2.jinja").read_text()
    with TestClient(create_app(settings_for(tiny_model_dir, chat_template=template))) as client:
        response = client.post("/v1/chat/completions", json={
            "model": "gpt2", "max_tokens": 2, "messages": [{"role": "assistant", "content": "I begin"}]})
        assert response.status_code == 400 and "roles must alternate" in error_of(response)[1]
        # A hostile conversation: huge content is bounded by the schema, before any rendering
        huge = [{"role": "user", "content": [{"type": "text", "text": "x"}] * 1000}]
        assert_validation_error(client.post("/v1/chat/completions", json={"model": "gpt2", "messages": huge}), "256")
        images = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
        assert_validation_error(client.post("/v1/chat/completions", json={"model": "gpt2", "messages": images}))


def test_a_hostile_template_is_a_400_and_the_server_serves_on(tiny_model_dir):
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with TestClient(create_app(settings_for(tiny_model_dir, chat_template=loop))) as client:
        response = post_chat(client, max_tokens=2)
        assert response.status_code == 400 and "longer than" in error_of(response)[1]
        assert client.post("/v1/completions", json={"model": "gpt2", "prompt": "x", "max_tokens": 2}).status_code == 200


def test_bad_chat_requests_are_422_in_openai_shape(chat):
    for body, words in [
        ({"messages": []}, ["messages"]),
        ({"top_logprobs": 2}, ["logprobs"]),
        ({"top_logprobs": 9, "logprobs": True}, ["top_logprobs"]),
        ({"tool_choice": "required"}, ["tools"]),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, ["'nope'"]),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, ["one of"]),
        ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, ["assistant"]),
        ({"max_tokens": 5000}, ["max_new_tokens", "1024"]),
        ({"max_tokens": 120}, ["128-token context"]),
    ]:
        response = chat.post("/v1/chat/completions", json={"model": "gpt2", "messages": MESSAGES, **body})
        assert_validation_error(response, *words)
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_models_by_id_and_unknown_routes(chat):
    assert chat.get("/v1/models/gpt2").json()["id"] == "gpt2"
    missing = chat.get("/v1/models/davinci")
    assert missing.status_code == 404 and error_of(missing)[0] == "model_not_found"
    assert error_of(post_chat(chat, model="davinci"))[0] == "model_not_found"
    for path in ("/v1/responses", "/nowhere"):
        unknown = chat.post(path, json={})
        kind, message = error_of(unknown)
        assert unknown.status_code == 404 and kind == "route_not_found"
        assert f"no route POST {path}" in message and "model" not in message
    assert "error_type" in chat.post("/nowhere", json={}).json()  # TGI's shape outside /v1


def test_a_dialogpt_shaped_folder_chats_with_its_own_template(tiny_model_dir, tmp_path, tokenizer):
    """GPT-2's architecture with DialoGPT's tokenizer_config.json: its template, no option needed."""
    for item in tiny_model_dir.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text((TEMPLATES / "dialogpt_tokenizer_config.json").read_text())
    turns = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "How?"}]
    with TestClient(create_app(settings_for(tmp_path))) as client:
        out = chat_ok(client, messages=turns, max_tokens=4, temperature=0)
    # DialoGPT's template: each turn's text and <|endoftext|>, nothing else.
    assert out["usage"]["prompt_tokens"] == len(tokenizer.encode("Hello<|endoftext|>Hi!<|endoftext|>How?<|endoftext|>"))
