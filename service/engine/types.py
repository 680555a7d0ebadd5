"""Plain data passed between the HTTP side and the engine core (the contract between them).

HTTP → schema → GenerationRequest → (IPC) → EngineCore.step → CoreStep → (IPC) →
    OutputProcessor (detokenize, stop strings) → TokenEvent* then one FinishedRequest (or
    RequestFailed) per request.
Every type here is a dataclass of plain values, so msgspec encodes it for the IPC as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# "error": the request failed (RequestFailed answers its client; no client sees this reason).
FinishReason = Literal["length", "eos_token", "stop_sequence", "cancelled", "error"]


class QueueFull(Exception):
    """The waiting queue is at its limit: the HTTP layer answers 429 and the client retries."""


class EngineStopped(Exception):
    """The engine is shutting down (draining) and takes no new work: answer 503."""


# bad_words_ids bounds: the engine keeps a fixed-size table per slot (input_batch.py).
MAX_BAD_WORDS = 32  # sequences per request
MAX_BAD_WORD_TOKENS = 8  # tokens per sequence


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding settings, validated by the schema layer before they get here."""

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    repetition_penalty: float = 1.0  # 1.0: off
    seed: int | None = None  # sampling without a seed gets a random one, reported back
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    num_return_sequences: int = 1
    prompt_logprobs: bool = False  # FinishedRequest.prompt_logprobs (TGI decoder_input_details)
    # The most likely alternatives reported per generated token (and, with prompt_logprobs, per
    # prompt token): OpenAI's logprobs=N, TGI's top_n_tokens, vLLM's prompt_logprobs=N.
    top_logprobs: int = 0
    # Decoding controls (model/logits_processors.py): transformers' meaning where it has them,
    # vLLM's for presence/frequency penalties.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_p: float = 0.0  # 0: off
    typical_p: float = 1.0  # 1.0: off
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # end the sequence as EOS does
    no_repeat_ngram_size: int = 0  # 0: off
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    speculate: bool = True  # draft from n-grams when the server speculates (service/engine/speculation.py)
    # Constrained decoding: llguidance's grammar text (service/engine/grammar.py), built by the
    # HTTP side from a JSON schema, regex, choice or Lark grammar; None: unconstrained.
    grammar: str | None = None

    def __post_init__(self) -> None:
        # One token id named twice keeps its last value, as transformers' sequence_bias and a JSON
        # object do. Resolved here, before any tensor sees the ids: an indexed assignment with
        # repeated indices keeps an unspecified one of the values on CUDA.
        if len({token for token, _ in self.logit_bias}) < len(self.logit_bias):
            object.__setattr__(self, "logit_bias", tuple(dict(self.logit_bias).items()))


# A token's most likely alternatives, most likely first: (token id, log-probability).
TopLogprobs = list[tuple[int, float]]


@dataclass
class PromptScores:
    """Per prompt token, the first left as None (nothing precedes it): how the model scored it."""

    logprobs: list[float | None]  # log p(token i | tokens before it)
    ranks: list[int | None]  # 1 + how many tokens the model found more likely
    top: list[TopLogprobs | None]  # SamplingParams.top_logprobs alternatives ([] when 0)


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() when the HTTP layer received it
    adapter: str | None = None  # a LoRA adapter's name (model/lora.py); None: the base model


@dataclass
class TokenEvent:
    """One new token of one sequence, streamed as soon as its text is safe to show."""

    request_id: str
    sequence_index: int  # which of num_return_sequences (0 for plain decoding)
    token_id: int
    text: str  # text this token releases (stop-string hold-back may delay or cut it)
    logprob: float
    time: float = 0.0  # time.monotonic() when the token was produced (inter-token latency)
    top_logprobs: TopLogprobs | None = None  # when the request asked for alternatives


@dataclass
class FinishedSequence:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: FinishReason
    score: float | None = None  # beam search: the length-penalised sequence score
    token_times: list[float] = field(default_factory=list)  # time.monotonic() per token
    top_logprobs: list[TopLogprobs] | None = None  # per token, when the request asked for them


@dataclass
class FinishedRequest:
    request_id: str
    sequences: list[FinishedSequence]
    prompt_tokens: int
    seed: int | None
    queue_seconds: float  # arrival → first scheduled
    first_token_seconds: float | None  # arrival → first token
    total_seconds: float
    extra: dict = field(default_factory=dict)
    # One entry per prompt token: None for the first, then log p(token | tokens before it).
    prompt_logprobs: list[float | None] | None = None
    prompt_scores: PromptScores | None = None  # the same with ranks and alternatives

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


@dataclass
class RequestFailed:
    """The engine could not finish this request: answer `status` with TGI's `error_type` (500
    "generation": the step failed; 404: its LoRA adapter was unloaded between the HTTP side's
    check and the core's; 424 / 422: its own row failed, service/engine/faults.py). `cause`
    labels the failure in metrics."""

    request_id: str
    message: str
    status: int = 500
    error_type: str = "generation"
    cause: str = "step"


@dataclass
class RequestStarted:
    """A request was admitted and prefilled this step (sent with its first tokens)."""

    request_id: str
    queue_seconds: float  # arrival → first scheduled
    seed: int | None  # the seed sampling uses (chosen by the core when the request gave none)
    prompt_scores: PromptScores | None = None


@dataclass
class RequestDone:
    """The core is done with a request: every sequence finished, or it was cancelled."""

    request_id: str
    # Beam search: the returned hypotheses, best first (text left empty: the HTTP side decodes).
    beams: list[FinishedSequence] | None = None


# (request id, sequence index, token id, log-probability, finish reason if this token ended it,
#  the token's top alternatives when its request asked for them)
CoreToken = tuple[str, int, int, float, FinishReason | None, TopLogprobs | None]


@dataclass
class StepTokens:
    """A step's new tokens as columns: entry i of each list is token i. The core fills them with
    a few list operations per step (whole columns from the step's arrays), not a tuple per token;
    the rare parts are kept by position. Iterating gives CoreToken tuples."""

    request_ids: list[str] = field(default_factory=list)
    indexes: list[int] = field(default_factory=list)  # sequence index within the request
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reasons: dict[int, FinishReason] = field(default_factory=dict)  # i → its sequence ended with it
    top: dict[int, TopLogprobs] = field(default_factory=dict)  # i → its alternatives, when asked for

    def append(self, token: CoreToken) -> None:
        request_id, index, token_id, logprob, reason, top = token
        position = len(self.token_ids)
        self.request_ids.append(request_id)
        self.indexes.append(index)
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        if reason is not None:
            self.reasons[position] = reason
        if top is not None:
            self.top[position] = top

    def __len__(self) -> int:
        return len(self.token_ids)

    def __iter__(self):
        reasons, top = self.reasons, self.top
        for position, (request_id, index, token_id, logprob) in enumerate(
            zip(self.request_ids, self.indexes, self.token_ids, self.logprobs)
        ):
            yield request_id, index, token_id, logprob, reasons.get(position), top.get(position)


@dataclass
class StepStats:
    """What one engine step did, for metrics (sent with the step's output to the HTTP side)."""

    batch_size: int  # sequences that got a token this step
    prefill_tokens: int  # prompt tokens computed this step (chunks; reused prefixes not counted)
    decode_tokens: int  # sequences that decoded one token from the cache
    running: int  # requests holding KV-cache slots after the step
    waiting: int  # requests queued for admission after the step
    kv_slots_used: int
    kv_slots_total: int
    step_seconds: float
    finished: int = 0  # requests that finished this step
    cached_prompt_tokens: int = 0  # prompt tokens admitted this step whose keys were cached
    decode_output_tokens: int = 0  # tokens the decoding sequences produced (> decode_tokens when drafts stood)
    draft_tokens: int = 0  # drafted tokens verified this step
    accepted_tokens: int = 0  # of which the model's own choice agreed
    # The KV cache's block pool (model/kv_cache.py): blocks running rows hold, of all.
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_hits: int = 0  # cached KV blocks the requests admitted this step shared
    prefix_evictions: int = 0  # cached KV blocks evicted this step to make room
    preemptions: int = 0  # running requests sent back to the queue this step for want of blocks

    @property
    def kv_usage_ratio(self) -> float:
        """Of the block pool when the step says (the tokens' memory), else of the rows."""
        if self.kv_blocks_total:
            return self.kv_blocks_used / self.kv_blocks_total
        return self.kv_slots_used / self.kv_slots_total

    def gauges(self) -> tuple[int, ...]:
        return self.running, self.waiting, self.kv_slots_used, self.kv_blocks_used

    def counted_anything(self) -> bool:
        return any((self.batch_size, self.prefill_tokens, self.decode_tokens, self.finished, self.cached_prompt_tokens,
                    self.decode_output_tokens, self.draft_tokens, self.prefix_hits, self.prefix_evictions,
                    self.preemptions))


@dataclass
class CoreStep:
    """Everything one engine-core step produced, sent to the HTTP side as one message."""

    tokens: StepTokens
    started: list[RequestStarted]
    done: list[RequestDone]
    failed: list[RequestFailed]
    stats: StepStats

    def computed_nothing(self) -> bool:
        """Nothing ran and nothing ended or started: the step waited on work off the loop (a
        grammar compiling on its own thread)."""
        return not (self.tokens.token_ids or self.started or self.done or self.failed or self.stats.counted_anything())

    def request_ids(self) -> list[str]:
        """Every request the step tells of, once each, in the order they first appear."""
        return list(dict.fromkeys([*self.tokens.request_ids, *(s.request_id for s in self.started),
                                   *(d.request_id for d in self.done), *(f.request_id for f in self.failed)]))
