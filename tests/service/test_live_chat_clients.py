"""Chat clients, unchanged, against a real server process serving a chat template: the `openai`
client, langchain-openai's ChatOpenAI, huggingface_hub's chat_completion and litellm, each used
as its own docs show for an OpenAI-compatible server. Any attempt of theirs to reach the network
fails the test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import huggingface_hub.constants
import jsonschema
import pytest
from huggingface_hub import InferenceClient
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field

from tests.service.live import forbid_network, live_server

pytestmark = pytest.mark.slow

CHATML = Path(__file__).parent / "chat_templates" / "chatml.jinja"
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Is the sea wet?"}]
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
           "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}}]


class Verdict(BaseModel):
    """A bounded answer: an untrained model finishes it within a few tokens (no other keys)."""

    model_config = ConfigDict(extra="forbid")
    answer: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with live_server(tiny_model_dir, chat_template=str(CHATML)) as running:
        yield running


@pytest.fixture
def oai(server, monkeypatch):
    forbid_network(monkeypatch)
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_chat_plain_stream_and_models(oai):
    whole = oai.chat.completions.create(model="gpt2", messages=MESSAGES, max_tokens=8, temperature=0)
    text = whole.choices[0].message.content
    assert isinstance(text, str) and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 8 or whole.choices[0].finish_reason == "stop"
    chunks = list(oai.chat.completions.create(model="gpt2", messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert oai.models.retrieve("gpt2").id == "gpt2"


def test_openai_chat_json_schema_and_tools(oai):
    schema = Verdict.model_json_schema()
    answer = oai.chat.completions.create(
        model="gpt2", messages=MESSAGES, max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}},
    )
    Verdict.model_validate_json(answer.choices[0].message.content)
    parsed = oai.chat.completions.parse(model="gpt2", messages=MESSAGES, max_tokens=30, response_format=Verdict)
    assert isinstance(parsed.choices[0].message.parsed, Verdict)

    called = oai.chat.completions.create(model="gpt2", messages=MESSAGES, max_tokens=30, tools=TOOLS,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    streamed = list(oai.chat.completions.create(model="gpt2", messages=MESSAGES, max_tokens=30, tools=TOOLS,
                                                tool_choice="required", parallel_tool_calls=False, stream=True))
    calls = [tc for c in streamed if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


def test_openai_client_errors(oai):
    from openai import BadRequestError, NotFoundError

    with pytest.raises(NotFoundError) as raised:
        oai.chat.completions.create(model="davinci", messages=MESSAGES, max_tokens=2)
    # OpenAI's error shape: the client reads the message and code from it.
    assert raised.value.code == "model_not_found" and "'davinci' is not served" in raised.value.message
    with pytest.raises(BadRequestError) as raised:
        oai.chat.completions.create(model="gpt2", messages=MESSAGES, max_tokens=2, tools=TOOLS, tool_choice="auto")
    assert "parser" in raised.value.message
    with pytest.raises(NotFoundError) as raised:
        oai.responses.create(model="gpt2", input="hi")
    assert raised.value.code == "route_not_found" and "no route POST /v1/responses" in raised.value.message


def test_langchain_chat_openai(server, monkeypatch):
    forbid_network(monkeypatch)
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="gpt2", temperature=0, max_tokens=8,
                     max_retries=0, timeout=60)
    reply = llm.invoke([("system", "Answer briefly."), ("human", "Is the sea wet?")])
    assert isinstance(reply.content, str) and reply.usage_metadata["output_tokens"] > 0
    pieces = [chunk.content for chunk in llm.stream([("system", "Answer briefly."), ("human", "Is the sea wet?")])]
    assert "".join(pieces) == reply.content
    roomier = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="gpt2", max_tokens=30, max_retries=0,
                         timeout=60)
    for method in ("json_schema", "function_calling"):  # response_format; a named tool_choice
        verdict = roomier.with_structured_output(Verdict, method=method).invoke("Is the sea wet?")
        assert isinstance(verdict, Verdict), method


def test_huggingface_hub_chat_completion(server, monkeypatch):
    forbid_network(monkeypatch)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    hf = InferenceClient(base_url=server.url, timeout=60)
    out = hf.chat_completion(MESSAGES, max_tokens=8, temperature=0)
    text = out.choices[0].message.content
    assert isinstance(text, str) and out.usage.prompt_tokens > 0
    streamed = "".join(c.choices[0].delta.content or "" for c in hf.chat_completion(MESSAGES, max_tokens=8, temperature=0,
                                                                                   stream=True) if c.choices)
    assert streamed == text
    # It sends "dummy" as the model (TGI ignores the name), and a json_schema in TGI's form.
    schema = {"name": "verdict", "schema": Verdict.model_json_schema()}
    answer = hf.chat_completion(MESSAGES, max_tokens=30, response_format={"type": "json_schema", "json_schema": schema})
    Verdict.model_validate_json(answer.choices[0].message.content)


def test_litellm_completion(server, monkeypatch):
    # Its model price list would otherwise be fetched from the network at import.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    forbid_network(monkeypatch)
    import litellm

    out = litellm.completion(model="openai/gpt2", api_base=server.url + "/v1", api_key="unused", messages=MESSAGES,
                             max_tokens=8, temperature=0)
    assert isinstance(out.choices[0].message.content, str) and out.usage.completion_tokens > 0
    pieces = [c.choices[0].delta.content or "" for c in litellm.completion(
        model="openai/gpt2", api_base=server.url + "/v1", api_key="unused", messages=MESSAGES, max_tokens=8,
        temperature=0, stream=True)]
    assert "".join(pieces) == out.choices[0].message.content
