"""Plain data passed between the HTTP layer and the engine loop (the contract between them).

HTTP → schema → GenerationRequest → scheduler/engine → TokenEvent* → FinishedRequest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["length", "eos_token", "stop_sequence", "cancelled"]


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding settings, validated by the schema layer before they get here."""

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    repetition_penalty: float = 1.0  # 1.0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    num_return_sequences: int = 1


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() when the HTTP layer received it


@dataclass
class TokenEvent:
    """One new token of one sequence, streamed as soon as its text is safe to show."""

    request_id: str
    sequence_index: int  # which of num_return_sequences (0 for plain decoding)
    token_id: int
    text: str  # text this token releases (stop-string hold-back may delay or cut it)
    logprob: float


@dataclass
class FinishedSequence:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: FinishReason
    score: float | None = None  # beam search: the length-penalised sequence score


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
