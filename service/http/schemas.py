"""The request fields and bounds the APIs share: strict JSON types and one rule for unknown keys,
static ceilings on every field, stop strings, stream options and the structured-output formats
(OpenAI's response_format and vLLM's structured_outputs; TGI's grammar takes the named schema).

Each API's own bodies build on these: service/http/schemas_tgi.py (TGI's /generate family),
schemas_openai.py (/v1/completions, /v1/models), schemas_chat.py (/v1/chat/completions).
Limits that depend on the deployment (settings) or on the prompt's token count are checked at
admission (service/http/admission.py), where both are known.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.common.schemas import Text

# Static ceilings: generous, only there so no field is unbounded. The configured limits
# (Settings) are tighter and checked at admission.
MAX_TEXT_CHARS = 1_000_000
MAX_LIST = 1024
MAX_TOKEN_ID = 2**31 - 1
MAX_SEED = 2**64 - 1
MAX_STOP_CHARS = 4096
# The smallest sampling temperature: logits / T must stay finite in float32 (1e-50 is 0 there,
# and 1e-40 still turns every logit into ±inf, so softmax gives NaN). Anything this small
# already samples the most likely token; greedy decoding says so directly.
MIN_TEMPERATURE = 1e-6
MAX_NGRAM = 32  # no_repeat_ngram_size
MAX_TOP_LOGPROBS = 5  # alternatives per token: OpenAI's logprobs limit, TGI's max_top_n_tokens default


def check_temperature(value: float | None, greedy_zero: bool) -> float | None:
    if value is None or (greedy_zero and value == 0.0):
        return value
    if value < MIN_TEMPERATURE:
        greedy = "0 for greedy decoding" if greedy_zero else "do_sample=false for greedy decoding"
        raise ValueError(f"temperature must be at least {MIN_TEMPERATURE:g} (smaller underflows; use {greedy})")
    return value


class StrictRequest(BaseModel):
    """Request bodies: JSON types exactly as declared ("3" and true are not the integer 3 or 1).

    One rule for keys this server does not know, at every level: tolerated when null (clients
    send every key they know), refused otherwise, naming them.
    """

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _refuse_unknown(self) -> "StrictRequest":
        unknown = sorted(k for k, v in (self.model_extra or {}).items() if v is not None)
        if unknown:
            raise ValueError(f"unsupported parameter(s): {', '.join(unknown)}")
        return self


def check_prompts(field: str, prompts: list[str] | list[list[int]]) -> None:
    """The static bounds of a request's prompts, each a text or a list of token ids."""
    if not prompts:
        raise ValueError(f"{field} is an empty list")
    if len(prompts) > MAX_LIST:
        raise ValueError(f"{field} has {len(prompts)} prompts; at most {MAX_LIST}")
    for prompt in prompts:
        if not prompt:
            raise ValueError(f"{field} must not be empty")
        is_text = isinstance(prompt, str)
        if len(prompt) > MAX_TEXT_CHARS:
            raise ValueError(f"a prompt has more than {MAX_TEXT_CHARS} {'characters' if is_text else 'token ids'}")
        if not is_text and any(not 0 <= t <= MAX_TOKEN_ID for t in prompt):
            raise ValueError(f"token ids must be between 0 and {MAX_TOKEN_ID}")


def text_list(value: str | list[str] | None) -> list[str]:
    """OpenAI's `stop`: none, one string or a list, as a list."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def check_stop_strings(stops: list[str]) -> None:
    if len(stops) > 64 or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"stop: at most 64 strings of 1 to {MAX_STOP_CHARS} characters")


class StreamOptions(StrictRequest):
    include_usage: bool = Field(False, description="a last chunk with the call's usage")
    continuous_usage_stats: bool = Field(False, description="vLLM's: every chunk carries the usage so far")


class JsonSchemaFormat(StrictRequest):
    name: str = Field("response", max_length=200)
    description: str | None = Field(None, max_length=10_000)
    schema_: dict | None = Field(None, alias="schema", description="the JSON schema; none: any JSON object")
    strict: bool | None = None


class ResponseFormat(StrictRequest):
    """OpenAI's response_format: text (unconstrained), any JSON object, or one JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: json_schema is given with type json_schema, and only then")
        return self


class StructuredOutputs(StrictRequest):
    """vLLM's structured_outputs: exactly one of a JSON schema, a regex, choices or a grammar."""

    json_: dict | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, max_length=1024)
    grammar: Text | None = Field(None, description="Lark (llguidance's syntax) or GBNF (llama.cpp's)")

    @model_validator(mode="after")
    def _one(self) -> "StructuredOutputs":
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar")
        return self
