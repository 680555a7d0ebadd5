"""OpenAI's chat completions request (POST /v1/chat/completions), with vLLM's extensions.

Every field is bounded here; what needs the settings, the tokenizer or the template is checked
at admission (service/http/routes_chat.py). A chat request becomes a /v1/completions request
on the rendered prompt's token ids (`completion_fields`), so both go through one admission.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from service.common.schemas import Text
from service.engine.types import MAX_BAD_WORDS
from service.http.schemas import (
    MAX_LIST,
    MAX_NGRAM,
    MAX_SEED,
    MAX_TEXT_CHARS,
    MAX_TOP_LOGPROBS,
    ResponseFormat,
    StreamOptions,
    StrictRequest,
    StructuredOutputs,
    check_stop_strings,
    check_temperature,
    text_list,
)

MAX_MESSAGES = 1024
MAX_PARTS = 256  # content parts per message
MAX_TOOLS = 128
MAX_KWARGS_CHARS = 100_000  # chat_template_kwargs, as JSON


class TextPart(StrictRequest):
    type: Literal["text"] = Field(description="only text parts: GPT-2 reads no images or audio")
    text: Text = Field(..., max_length=MAX_TEXT_CHARS)


class FunctionCall(StrictRequest):
    name: str = Field(..., max_length=200)
    arguments: str = Field(..., max_length=MAX_TEXT_CHARS)


class ToolCall(StrictRequest):
    """A tool call of an earlier assistant turn, sent back with the conversation."""

    id: str = Field(..., max_length=200)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = Field(None, max_length=MAX_TEXT_CHARS)
    name: str | None = Field(None, max_length=200)
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=200)

    @model_validator(mode="after")
    def _bounded(self) -> "ChatMessage":
        if isinstance(self.content, list) and len(self.content) > MAX_PARTS:
            raise ValueError(f"a message has {len(self.content)} content parts; at most {MAX_PARTS}")
        if self.content is None and not self.tool_calls:
            raise ValueError("a message has content (or, from the assistant, tool_calls)")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text parts joined into one string (vLLM's
        "string" content format), None fields left out (as transformers drops them)."""
        message: dict[str, Any] = {"role": self.role}
        if self.content is not None:
            message["content"] = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(StrictRequest):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = Field(None, max_length=10_000)
    parameters: dict | None = Field(None, description="its arguments' JSON schema; none: no arguments")
    strict: bool | None = None


class Tool(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictRequest):
    name: str = Field(..., max_length=64)


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: NamedFunction


class ChatResponseFormat(ResponseFormat):
    """OpenAI's response_format, or TGI's chat form of it: {"type": "json_object", "value": <schema>}
    (what huggingface_hub's chat_completion sends for a json_schema)."""

    value: dict | None = Field(None, description="TGI's: the schema of a json_object")

    def as_openai(self) -> ResponseFormat:
        if self.value is None:
            return ResponseFormat.model_validate(self.model_dump(by_alias=True, exclude={"value"}))
        return ResponseFormat(type="json_schema", json_schema={"name": "response", "schema": self.value})


class ChatCompletionRequest(StrictRequest):
    model: str = Field(..., max_length=200)
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=1_000_000, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000, description="none: what the context leaves")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives per token (logprobs=true)")
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LIST, description="token id → -100..100")
    user: str | None = Field(None, max_length=1000)
    response_format: ChatResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = Field(True, description="false: at most one call with tool_choice required")
    # vLLM's extensions.
    top_k: int = Field(0, ge=0, le=1_000_000, description="0: off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=1_000_000)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    no_repeat_ngram_size: int = Field(0, ge=0, le=MAX_NGRAM)
    bad_words_ids: list[list[int]] | None = Field(None, max_length=MAX_BAD_WORDS)
    speculate: bool = True
    structured_outputs: StructuredOutputs | None = None
    add_generation_prompt: bool = Field(True, description="end the prompt with the assistant's turn opening")
    continue_final_message: bool = Field(False, description="continue the last (assistant) message instead")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="more variables for the chat template")

    @model_validator(mode="after")
    def _consistent(self) -> "ChatCompletionRequest":
        check_temperature(self.temperature, greedy_zero=True)
        if self.logit_bias and any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be between -100 and 100")
        check_stop_strings(self.stop_list)
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ; give one")
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message continues a final assistant message")
        structured = [name for name in ("response_format", "structured_outputs") if self.constrains(name)]
        if len(structured) > 1 or (structured and self.calls_tools):
            raise ValueError("give one of response_format, structured_outputs or a tool_choice that calls a tool")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, not one of the tools {names}")
        return self

    def constrains(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not None and not (isinstance(value, ResponseFormat) and value.type == "text")

    @property
    def calls_tools(self) -> bool:
        """The answer must be a tool call: tool_choice names a function, or is "required"."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    @property
    def stop_list(self) -> list[str]:
        return text_list(self.stop)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def completion_fields(self) -> dict[str, Any]:
        """The /v1/completions fields that mean the same here (the prompt and the constraint
        are the route's to add)."""
        fields = {name: getattr(self, name) for name in (
            "model", "temperature", "top_p", "n", "stream", "seed", "presence_penalty", "frequency_penalty",
            "user", "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "no_repeat_ngram_size",
            "speculate",
        )}
        for name in ("logit_bias", "stop_token_ids", "bad_words_ids", "response_format", "structured_outputs"):
            value = getattr(self, name)
            if isinstance(value, ChatResponseFormat):
                value = value.as_openai()
            if value is not None:
                fields[name] = value if not hasattr(value, "model_dump") else value.model_dump(by_alias=True, exclude_none=True)
        fields["stop"] = self.stop_list or None
        fields["stream_options"] = None if self.stream_options is None else self.stream_options.model_dump()
        # The chat shape's logprobs=true, top_logprobs=N is the completions' logprobs=N.
        fields["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return fields
