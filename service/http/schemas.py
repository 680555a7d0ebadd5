"""Request and response bodies: TGI's /generate family, OpenAI's /v1/completions, /tokenize, /info.

Every request field has bounds here. Limits that depend on the deployment (settings) or on the
prompt's token count are checked at admission (service/http/admission.py), where both are known.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.common.schemas import Text
from service.engine.types import MAX_BAD_WORDS

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


# ---------------------------------------------------------------------------------------------
# TGI: POST /generate, /generate_stream, /
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# OpenAI: POST /v1/completions, GET /v1/models
# ---------------------------------------------------------------------------------------------


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


# Names a LoRA adapter may have: what a URL path segment and a metric label carry as they are.
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class LoadAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(pattern=ADAPTER_NAME, description="the name requests will give it (OpenAI model, TGI adapter_id)")
    lora_path: str = Field(min_length=1, max_length=4096, description="its peft folder on the server's machine")


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(pattern=ADAPTER_NAME)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------------------------------
# /tokenize, /info, /health
# ---------------------------------------------------------------------------------------------


class TokenizeRequest(StrictRequest):
    inputs: Text = Field(..., min_length=1, max_length=MAX_TEXT_CHARS)
    parameters: dict[str, Any] | None = Field(None, description="accepted for TGI compatibility, ignored")


class SimpleToken(BaseModel):
    id: int
    text: str
    start: int = Field(description="character offset of the token's text in `inputs`")
    stop: int


class Info(BaseModel):
    model_id: str
    model_dtype: str
    model_device_type: str
    config: dict = Field(description="the GPT-2 hyper-parameters")
    weights_origin: dict
    quantization: dict = Field(
        description="mode (--quantize); the weights generation runs on (engine core) and those the /analyze routes"
        " read (always the float ones); method (null: none)"
    )
    max_input_tokens: int
    max_total_tokens: int
    max_new_tokens: int
    max_batch_size: int
    max_waiting_requests: int
    max_stop_sequences: int
    max_best_of: int
    max_prompts_per_request: int
    max_body_bytes: int
    kv_cache: dict = Field(description="slots used and total right now, and whether prompts reuse cached prefixes")
    max_prefill_tokens_per_step: int = Field(description="prompt tokens one engine step prefills; longer prompts go in chunks")
    speculative_decoding: dict = Field(description="n-gram drafts: method (null: off), n-gram sizes, the most tokens drafted per step, rows per weight pass (how drafts are priced)")
    grammar: dict = Field(description="constrained decoding: the grammar engine and the kinds of grammar served (json, regex, choice, grammar)")
    version: str

    model_config = ConfigDict(protected_namespaces=())
