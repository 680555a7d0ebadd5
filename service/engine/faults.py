"""What ends one request alone: the faults a step can pin on a row, and the injection of
non-finite logits that the chaos tests use.

A step serves many requests at once, so anything that goes wrong in one row (logits that are
not finite, a grammar that fails, a beam search that raises), or in starting one admitted
request, must end that request and no other. Only a failure the core cannot attribute to a row
(a forward that raises, a broken device) fails the whole step.

Detection costs the step nothing: a row's token log-probability, which the sampler copies to
the host anyway, is finite exactly when its logits are (log_softmax of a row holding a NaN or
+inf, or one whose grammar allowed nothing, is NaN), so the reader checks the column it reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# What metrics and logs call each cause (`gpt2_request_failures_total{cause}`).
NONFINITE = "nonfinite_logits"
GRAMMAR = "grammar"
BEAM = "beam_search"
START = "start"


@dataclass(frozen=True)
class RowFault:
    """Why one request failed, and how its client is answered (TGI's error types: a grammar
    is the request's own input, 422 "validation"; anything else the model produced is a
    424 "generation" error, as TGI answers a failed generation)."""

    cause: str
    message: str
    status: int = 424
    error_type: str = "generation"


def nonfinite(token_index: int) -> RowFault:
    return RowFault(NONFINITE, f"the model's logits were not finite (NaN or inf) at generated token {token_index}")


def grammar_failed(error: str) -> RowFault:
    return RowFault(GRAMMAR, f"the grammar failed during generation: {error}", 422, "validation")


def beam_failed(exc: Exception) -> RowFault:
    return RowFault(BEAM, f"beam search failed: {type(exc).__name__}: {exc}")


def start_failed(exc: Exception) -> RowFault:
    """Starting an admitted request raised (its beam search, its grammar's matcher, its prompt's
    blocks): nothing of the model's, so an internal error (500) of that request alone."""
    return RowFault(START, f"the request could not start: {type(exc).__name__}: {exc}", 500)


class RowFaultError(Exception):
    """Raised where a row's own computation fails; the core ends that request alone."""

    def __init__(self, fault: RowFault) -> None:
        super().__init__(fault.message)
        self.fault = fault


# GPT2_INJECT_NONFINITE="seed=S,after=N[,value=nan|inf]": rows of requests sampled with seed S
# get non-finite logits from their N-th generated token on. For the chaos tests only (a fault
# no real model reaches on demand); read once by the engine core, off when unset.
INJECT_ENV = "GPT2_INJECT_NONFINITE"


@dataclass(frozen=True)
class NonfiniteInjection:
    seed: int
    after: int
    value: float

    @classmethod
    def from_env(cls) -> NonfiniteInjection | None:
        spec = os.environ.get(INJECT_ENV)
        if not spec:
            return None
        fields = dict(part.split("=", 1) for part in spec.split(","))
        return cls(int(fields["seed"]), int(fields.get("after", 0)), float(fields.get("value", "nan")))

    def apply(self, logits: torch.Tensor, rows: list[tuple[int | None, int]]) -> torch.Tensor:
        """`rows`: per logits row, (its request's seed, tokens generated so far)."""
        hit = [seed == self.seed and generated >= self.after for seed, generated in rows]
        if not any(hit):
            return logits
        mask = torch.tensor(hit, device=logits.device)[:, None]
        return logits.masked_fill(mask, self.value)
