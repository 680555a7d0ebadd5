"""OpenAI's chat completions: POST /v1/chat/completions (with stream), as vLLM serves it.

The conversation is rendered by the served chat template (service/http/chat_template.py) and
tokenized; from there the call is a /v1/completions call on those token ids: the same
admission (service/http/routes_openai.py admit), the same engine requests, the same usage.
Only the answer's shape differs: a message (or tool calls) per choice, deltas when streamed.

Tool calls go through the grammar engine, as vLLM does without a tool parser: `tool_choice`
naming a function constrains the output to its parameters' JSON schema (the text is the call's
`arguments`); `"required"` to a JSON array of {name, parameters} among the tools. `"auto"`
would need the model's own tool-call syntax parsed out of free text: refused, saying so.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from service.common.errors import ApiError, describe_validation_errors, error_body
from service.common.metrics import set_outcome
from service.engine.types import FinishedRequest, FinishedSequence, TokenEvent, TopLogprobs
from service.http.admission import tokenize_off_loop
from service.http.body_writer import body_writer
from service.http.chat_template import TemplateError
from service.http.generation import CallStreams
from service.http.routes_openai import Call, admit, answer, openai_finish_reason
from service.http.routes_tgi import ERRORS
from service.http.schemas_openai import CompletionRequest
from service.http.schemas_chat import MAX_KWARGS_CHARS, ChatCompletionRequest, NamedToolChoice
from service.http.sse import DONE, SERVER_SEND, encode_json, json_string, sse
from service.http.state import ServiceState, service_state
from weights.tokenizer import GPT2Tokenizer

router = APIRouter(prefix="/v1", tags=["OpenAI"])

NO_TEMPLATE = (
    "this model has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json): start the "
    "server with --chat-template FILE_OR_STRING to serve /v1/chat/completions, or use /v1/completions"
)


@router.post(
    "/chat/completions",
    responses={200: {"content": {"text/event-stream": {}}}, 400: {"description": "no chat template, or the template"
               " refused the conversation"}, **ERRORS},
    summary="Chat (OpenAI chat completions schema, vLLM's extensions); stream=true for server-sent events",
)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = service_state(request)
    call = await admit(state, await completion_request(state, body), prefix="chatcmpl")
    chat = ChatCall(call, body)
    return await answer(state, call, request, lambda batch: chat_chunks(state, chat, batch, request),
                        lambda results: chat_body(chat, results, state.tokenizer))


async def completion_request(state: ServiceState, body: ChatCompletionRequest) -> CompletionRequest:
    """The /v1/completions request this chat call is: the rendered prompt's ids, the same
    sampling, the tool call's schema as its structured output."""
    if body.tools and body.tool_choice in (None, "auto"):
        raise ApiError(400, "validation", "tool_choice \"auto\" (the default with tools) needs a parser for the model's"
                       " own tool-call syntax, which this server has none of: name a function in tool_choice, or"
                       " \"required\", to have the output constrained to a call; \"none\" for text")
    ids = await prompt_ids(state, body)
    fields = body.completion_fields()
    fields["prompt"] = ids
    limits = state.limits
    fields["max_tokens"] = body.max_new_tokens or max(1, min(limits.max_new_tokens, limits.context_length - len(ids)))
    if body.calls_tools:
        fields["structured_outputs"] = {"json": tool_call_schema(body)}
    try:
        return CompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise ApiError(422, "validation", describe_validation_errors(list(exc.errors()))) from None


async def prompt_ids(state: ServiceState, body: ChatCompletionRequest) -> list[int]:
    template = state.chat_template
    if template is None:
        raise ApiError(400, "template_error", NO_TEMPLATE)
    kwargs = body.chat_template_kwargs or {}
    if len(json.dumps(kwargs, default=str)) > MAX_KWARGS_CHARS:
        raise ApiError(422, "validation", f"chat_template_kwargs: at most {MAX_KWARGS_CHARS} characters as JSON")
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    try:
        # In a worker thread: a template may run up to its time bound, and the loop must not wait.
        text = await run_in_threadpool(
            template.render, [m.for_template() for m in body.messages], add_generation_prompt=body.add_generation_prompt
            and not body.continue_final_message, continue_final_message=body.continue_final_message, tools=tools,
            kwargs=kwargs,
        )
    except TemplateError as exc:
        raise ApiError(400, "template_error", f"{template.origin}: {exc}") from None
    (prompt,) = await tokenize_off_loop(state.tokenizer, [text])
    if not prompt.ids:
        raise ApiError(400, "template_error", f"{template.origin}: the chat template rendered this conversation as no text")
    return prompt.ids


def tool_call_schema(body: ChatCompletionRequest) -> dict:
    """The JSON schema a forced tool call's output follows (vLLM's, for named and required)."""
    functions = {t.function.name: t.function for t in body.tools or []}

    def parameters(name: str) -> dict:
        schema = functions[name].parameters
        return schema if schema else {"type": "object", "properties": {}, "additionalProperties": False}

    if isinstance(body.tool_choice, NamedToolChoice):
        return parameters(body.tool_choice.function.name)
    calls = [
        {"type": "object", "properties": {"name": {"enum": [name]}, "parameters": parameters(name)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for name in functions
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


class ChatCall:
    """A chat call's answer shape around its completions Call."""

    def __init__(self, call: Call, body: ChatCompletionRequest) -> None:
        self.call = call
        self.body = body
        self.named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
        self.required = body.calls_tools and self.named is None
        self._delta_head: str | None = None

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.call.id, "object": "chat.completion.chunk", "created": self.call.created,
               "model": self.call.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def content_event(self, index: int, event: TokenEvent) -> bytes:
        """sse(self.chunk([{index, delta: {content}, logprobs: None, finish_reason: None}])) of the
        event's text for choice `index`, written directly as routes_openai.Call.text_event is: the
        event sent per token."""
        if self._delta_head is None:
            self._delta_head = "data: " + encode_json(self.chunk([]))[: -len("]}")]
        return (f'{self._delta_head}{{"index": {index}, "delta": {{"content": {json_string(event.text)}}}, '
                f'"logprobs": null, "finish_reason": null}}]}}\n\n').encode()

    def message(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """The assistant's message for a finished sequence's text, and its finish reason."""
        if self.named is not None:
            call = tool_call(self.named, text)
            return {"role": "assistant", "content": None, "tool_calls": [call]}, finish_reason
        if self.required:
            calls = parsed_calls(text)
            if calls is not None:
                return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": text, "tool_calls": []}, finish_reason


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def parsed_calls(text: str) -> list[dict] | None:
    """The calls of a "required" answer (a JSON array of {name, parameters}); None when it was
    cut short (max_tokens) and does not parse."""
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    return [tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]


def chat_logprobs(ids: list[int], logprobs: list[float], tops: list[TopLogprobs | None], n: int,
                  tokenizer: GPT2Tokenizer) -> dict:
    """OpenAI's chat `logprobs`: per token its text, log-probability, UTF-8 bytes and n alternatives."""
    def entry(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [
        {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in (top or [])[:n]]}
        for token, logprob, top in zip(ids, logprobs, tops)
    ]}


# --- whole answers -------------------------------------------------------------------------------


def chat_body(chat: ChatCall, results: list[FinishedRequest], tokenizer: GPT2Tokenizer) -> dict:
    call, choices = chat.call, []
    for request_index, result in enumerate(results):
        for sequence_index, seq in enumerate(result.sequences):
            choices.append(chat_choice(chat, call.choice_index(request_index, sequence_index), seq, tokenizer))
    usage = call.usage(sum(r.generated_tokens for r in results))
    out = {"id": call.id, "object": "chat.completion", "created": call.created, "model": call.model,
           "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage}
    return out


def chat_choice(chat: ChatCall, index: int, seq: FinishedSequence, tokenizer: GPT2Tokenizer) -> dict:
    message, finish_reason = chat.message(seq.text, openai_finish_reason(seq.finish_reason))
    logprobs = None
    if chat.body.logprobs:
        tops = list(seq.top_logprobs or [None] * len(seq.token_ids))
        logprobs = chat_logprobs(list(seq.token_ids), list(seq.logprobs), tops, chat.body.top_logprobs or 0, tokenizer)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


# --- streaming -----------------------------------------------------------------------------------


async def chat_chunks(state: ServiceState, chat: ChatCall, batch: CallStreams, request: Request) -> AsyncIterator[bytes]:
    call, body, tokenizer = chat.call, chat.body, state.tokenizer
    options = body.stream_options
    continuous = options is not None and options.continuous_usage_stats
    # A "required" answer is parsed whole (its calls are known only at the end): sent as one delta.
    buffered: dict[int, str] | None = {} if chat.required else None
    # Content deltas alone, nothing to add per token: written from a template.
    content_only = not body.logprobs and not continuous and buffered is None and chat.named is None
    plain = content_only and len(call.requests) == 1 and body.n == 1
    writer = body_writer(request.scope.get(SERVER_SEND)) if plain else None
    # Its one choice is choice 0.
    direct = writer.token_sink(partial(chat.content_event, 0)) if writer is not None else None
    streamed = generated = 0

    def usage() -> dict | None:
        return call.usage(streamed) if continuous else None

    try:
        first = []
        for request_index in range(len(call.requests)):
            for sequence_index in range(body.n // call.copies):
                index = call.choice_index(request_index, sequence_index)
                delta = {"role": "assistant", "content": None if chat.named or chat.required else ""}
                if chat.named is not None:
                    call_start = tool_call(chat.named, "")
                    delta["tool_calls"] = [{"index": 0, **call_start}]
                first.append({"index": index, "delta": delta, "logprobs": None, "finish_reason": None})
        yield sse(chat.chunk(first, usage()))
        async for arrived in state.generations.events(batch, request, direct):
            events = []
            for request_index, items in arrived:
                for item in items:
                    if isinstance(item, TokenEvent):
                        streamed += 1
                        index = call.choice_index(request_index, item.sequence_index)
                        if buffered is not None:
                            buffered[index] = buffered.get(index, "") + item.text
                            continue
                        if content_only:
                            events.append(chat.content_event(index, item))
                            continue
                        delta = {"tool_calls": [{"index": 0, "function": {"arguments": item.text}}]} \
                            if chat.named is not None else {"content": item.text}
                        logprobs = chat_logprobs([item.token_id], [item.logprob], [item.top_logprobs],
                                                 body.top_logprobs or 0, tokenizer) if body.logprobs else None
                        events.append(sse(chat.chunk([{"index": index, "delta": delta, "logprobs": logprobs,
                                                       "finish_reason": None}], usage())))
                    elif isinstance(item, FinishedRequest):
                        generated += item.generated_tokens
                        finals = []
                        for j, seq in enumerate(item.sequences):
                            index = call.choice_index(request_index, j)
                            reason = openai_finish_reason(seq.finish_reason)
                            delta: dict = {}
                            if buffered is not None:
                                message, reason = chat.message(buffered.get(index, ""), reason)
                                delta = {"content": message["content"]} if message["content"] is not None else \
                                    {"tool_calls": [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]}
                            finals.append({"index": index, "delta": delta, "logprobs": None, "finish_reason": reason})
                        events.append(sse(chat.chunk(finals, usage())))
            yield b"".join(events)
        if options is not None and options.include_usage:
            yield sse(chat.chunk([], call.usage(generated)))
        yield DONE
    except ApiError as exc:
        set_outcome(request, "error")
        yield sse(error_body(exc.error_type, exc.message, "/v1/chat/completions", exc.status))
