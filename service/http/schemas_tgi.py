"""TGI's request and response bodies: POST /generate, /generate_stream and /.

Every field is bounded here (the shared ceilings and checks: service/http/schemas.py); what
needs the settings or the prompt's token count is checked at admission (service/http/admission.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from service.common.schemas import Text
from service.engine.types import MAX_BAD_WORDS
from service.http.schemas import (
    MAX_NGRAM,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_TOP_LOGPROBS,
    JsonSchemaFormat,
    StrictRequest,
    check_prompts,
    check_temperature,
)


class TGIGrammar(StrictRequest):
    """TGI's grammar: a JSON schema (an object, or its JSON text), TGI 3's named schema
    (`json_schema`: `{"name": ..., "schema": {...}}`, as OpenAI's response_format carries it) or
    a regular expression."""

    type: Literal["json", "json_schema", "regex"]
    value: dict | Text = Field(..., description='json: the schema; json_schema: {"name": ..., "schema": {...}}; regex: the expression')

    @model_validator(mode="after")
    def _named_schema(self) -> "TGIGrammar":
        if self.type == "json_schema":
            if not isinstance(self.value, dict):
                raise ValueError('grammar.value: a json_schema grammar\'s value is {"name": ..., "schema": {...}}')
            self.value = JsonSchemaFormat.model_validate(self.value)
        return self


class TGIParameters(StrictRequest):
    best_of: int | None = Field(None, ge=1, le=64, description="sample this many, return the most likely")
    decoder_input_details: bool = Field(False, description="return the prompt tokens with their logprobs")
    details: bool = Field(False, description="return tokens, logprobs and the finish reason")
    do_sample: bool = False
    max_new_tokens: int | None = Field(None, ge=1, le=1_000_000)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    return_full_text: bool | None = Field(None, description="prepend the prompt to generated_text")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[Text] = Field(default_factory=list, max_length=64)
    temperature: float | None = Field(None, gt=0.0, le=100.0)
    top_k: int | None = Field(None, gt=0, le=1_000_000)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    truncate: int | None = Field(None, ge=1, le=1_000_000, description="keep only the last N prompt tokens")
    top_n_tokens: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives per generated token")
    typical_p: float | None = Field(None, gt=0.0, le=1.0, description="locally typical sampling (transformers')")
    # Known to TGI but not computed here: accepted only at their neutral value.
    watermark: bool = False
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    grammar: TGIGrammar | None = Field(None, description="constrain the output to a JSON schema or a regex")
    adapter_id: str | None = Field(None, min_length=1, max_length=200, description="a LoRA adapter served (GET /v1/models)")
    # Extensions beyond TGI, with transformers' meanings.
    num_beams: int = Field(1, ge=1, le=64)
    length_penalty: float = Field(1.0, ge=-100.0, le=100.0)
    early_stopping: bool | Literal["never"] = False
    num_return_sequences: int = Field(1, ge=1, le=64)
    ignore_eos: bool = False
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_new_tokens: int | None = Field(None, ge=0, le=1_000_000)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    no_repeat_ngram_size: int | None = Field(None, ge=0, le=MAX_NGRAM)
    bad_words_ids: list[list[int]] | None = Field(None, max_length=MAX_BAD_WORDS)
    speculate: bool = Field(True, description="false: no n-gram drafts for this request (when the server speculates)")

    @model_validator(mode="after")
    def _consistent(self) -> "TGIParameters":
        check_temperature(self.temperature, greedy_zero=False)
        for name, neutral in (("watermark", (False,)), ("frequency_penalty", (None, 0.0))):
            if getattr(self, name) not in neutral:
                raise ValueError(f"{name} is not supported by this server")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        if self.num_beams > 1 and self.samples:
            raise ValueError(
                "beam search (num_beams > 1) cannot be combined with sampling (do_sample, temperature,"
                " top_k or top_p); choose one"
            )
        if self.num_beams > 1 and self.num_return_sequences > self.num_beams:
            raise ValueError(
                f"num_return_sequences ({self.num_return_sequences}) cannot exceed num_beams ({self.num_beams})"
            )
        if self.num_beams == 1 and not self.samples and self.num_return_sequences > 1:
            raise ValueError("num_return_sequences > 1 needs sampling or beam search: greedy gives one answer")
        if (self.best_of or 1) > 1:
            if not self.samples:
                raise ValueError("best_of > 1 needs sampling (do_sample=true)")
            if self.num_beams > 1 or self.num_return_sequences > 1:
                raise ValueError("best_of cannot be combined with num_beams or num_return_sequences")
        return self

    @property
    def samples(self) -> bool:
        # As TGI: setting a sampling warper turns sampling on.
        return (
            self.do_sample
            or (self.temperature is not None and self.temperature != 1.0)
            or (self.top_k is not None)
            or (self.top_p is not None and self.top_p < 1.0)
            or (self.typical_p is not None and self.typical_p < 1.0)
            or bool(self.min_p)
        )


class TGIRequest(StrictRequest):
    inputs: Text | list[Text] = Field(
        ..., description="a prompt, or a list of prompts generated together and answered as a list"
    )
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = Field(False, description="POST / only: answer as /generate_stream")

    @model_validator(mode="after")
    def _bounded_inputs(self) -> "TGIRequest":
        check_prompts("inputs", self.prompts)
        return self

    @property
    def prompts(self) -> list[str]:
        return [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None


class Token(BaseModel):
    id: int
    text: str
    logprob: float
    special: bool


TGIFinishReason = Literal["length", "eos_token", "stop_sequence"]


class BestOfSequence(BaseModel):
    generated_text: str
    finish_reason: TGIFinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]


class Details(BaseModel):
    finish_reason: TGIFinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None  # top_n_tokens alternatives per generated token
    best_of_sequences: list[BestOfSequence] | None = None


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: TGIFinishReason
    generated_tokens: int
    input_length: int
    seed: int | None


class StreamResponse(BaseModel):
    index: int
    token: Token
    top_tokens: list[Token] | None = None
    generated_text: str | None = None
    details: StreamDetails | None = None
