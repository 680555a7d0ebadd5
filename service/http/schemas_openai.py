"""OpenAI's completions request and response (POST /v1/completions), with vLLM's extensions, and
the model list (GET /v1/models).

Every field is bounded here (the shared ceilings and checks: service/http/schemas.py); what
needs the settings or the prompt's token count is checked at admission (service/http/admission.py).
The chat request (service/http/schemas_chat.py) becomes one of these on its rendered prompt.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

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
    check_prompts,
    check_stop_strings,
    check_temperature,
    text_list,
)


class CompletionRequest(StrictRequest):
    model: str = Field(..., max_length=200)
    prompt: Text | list[Text] | list[int] | list[list[int]] = Field(..., description="text(s) or token ids")
    max_tokens: int | None = Field(16, ge=0, le=1_000_000, description="0 with echo: score the prompt only")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=64)
    best_of: int | None = Field(None, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="N: the N most likely alternatives too")
    echo: bool = False
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LIST, description="token id → -100..100")
    suffix: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    user: str | None = Field(None, max_length=1000)
    # Extensions (as vLLM names them), with transformers' meanings.
    top_k: int = Field(0, ge=0, le=1_000_000, description="0: off")
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="vLLM's: each prompt token's logprob, rank and N alternatives"
    )
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    typical_p: float = Field(1.0, gt=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0, le=1_000_000, description="vLLM's name for min_new_tokens")
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    no_repeat_ngram_size: int = Field(0, ge=0, le=MAX_NGRAM)
    bad_words_ids: list[list[int]] | None = Field(None, max_length=MAX_BAD_WORDS)
    speculate: bool = Field(True, description="false: no n-gram drafts for this request (when the server speculates)")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "CompletionRequest":
        check_temperature(self.temperature, greedy_zero=True)
        if self.max_tokens == 0 and not (self.echo or self.prompt_logprobs is not None):
            raise ValueError("max_tokens=0 scores the prompt: it needs echo=true or prompt_logprobs")
        if self.max_tokens == 0 and self.stream:
            raise ValueError("max_tokens=0 (scoring only) is answered whole: set stream=false")
        if self.logit_bias and any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be between -100 and 100")
        if self.suffix:
            raise ValueError("suffix is not supported: GPT-2 cannot fill in the middle")
        check_stop_strings(self.stop_list)
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.stream and (self.best_of or self.n) > self.n:
            raise ValueError("best_of > n cannot be streamed")
        check_prompts("prompt", self.prompt_list)
        if self.structured_outputs is not None and self.response_format not in (None, ResponseFormat(type="text")):
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    @property
    def stop_list(self) -> list[str]:
        return text_list(self.stop)

    @property
    def prompt_list(self) -> list[str | list[int]]:
        """One entry per prompt: a string, or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    # vLLM's extension: per prompt token (None for the first), keyed by token id.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    parent: str | None = None  # a LoRA adapter's base model (vLLM's card)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
