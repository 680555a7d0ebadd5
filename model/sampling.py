"""Choosing the next token: pure functions over [batch, vocab] logits with per-row parameters.

Every parameter is a tensor with one entry per row, so one call serves a batch that mixes
greedy and sampled rows with different temperatures, top-k, top-p and repetition penalties.
The semantics are those of transformers' logits processors, applied in generate()'s order:
repetition penalty, then (sampling only) temperature, top-k, top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.logits_processors import Controls, apply_controls, apply_warpers
from model.vocab_sort import sort_ascending


@dataclass
class SamplingTensors:
    """Per-row decoding parameters of one batch, on the logits' device.

    The flags say whether any row needs a stage at all, so a batch that does not use a stage
    skips it (plain Python booleans: checking them needs no device sync).
    """

    temperature: torch.Tensor  # [B] float; 1.0 for greedy rows
    top_k: torch.Tensor  # [B] long; vocab size means off
    top_p: torch.Tensor  # [B] float; 1.0 means off
    repetition_penalty: torch.Tensor  # [B] float; 1.0 means off
    do_sample: torch.Tensor  # [B] bool
    seed: torch.Tensor  # [B] int64; a sampled row's draws come from (seed, counter) alone
    any_sample: bool
    any_top_k_top_p: bool
    any_penalty: bool
    # logit_bias, presence/frequency, n-grams, bad words, min_new_tokens, min_p, typical_p
    # (model/logits_processors.py); None when no row uses any.
    controls: Controls | None = None


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor | float
) -> torch.Tensor:
    """Divide positive and multiply negative logits of tokens already seen (transformers' rule).

    logits [B, V]; seen [B, V] bool, True for every token of the prompt and the output so far;
    penalty [B], or one float for every row. A token repeated many times is penalised once, as
    in transformers.
    """
    if isinstance(penalty, torch.Tensor):
        penalty = penalty[:, None]  # [B, 1]
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)  # [B, V]
    return torch.where(seen, penalised, logits)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return logits / temperature[:, None]  # [B, V]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k, then outside its top-p nucleus.

    top_k [B] long (k >= vocab keeps all), top_p [B] float (1.0 keeps all). Ties with the k-th
    largest logit are kept, and the most likely token always survives top-p, as in transformers.
    """
    vocab = logits.shape[-1]
    # Ascending, equal logits highest id first (a stable descending sort, reversed): where the
    # nucleus cuts through equal logits, the lowest ids stay. transformers' unstable sort leaves
    # that to the kernel, which orders ties differently by device and shape. The values run in
    # the same order either way, so the cumulative sums are transformers' to the bit.
    sorted_logits, sorted_index = sort_ascending(logits, ties_high_index_first=True)  # [B, V] ascending
    # The k-th largest value sits at ascending index V - k.
    kth_index = (vocab - top_k.clamp(1, vocab))[:, None]  # [B, 1]
    kth_largest = sorted_logits.gather(1, kth_index)  # [B, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    outside_nucleus = cumulative <= (1 - top_p)[:, None]  # [B, V]
    outside_nucleus[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(outside_nucleus, float("-inf"))
    return sorted_logits.scatter(1, sorted_index, sorted_logits)  # [B, V] original order


# splitmix64's constants (Steele, Lea, Flood 2014), as signed int64 for torch's integer ops.
def _int64(constant: int) -> int:
    return constant - (1 << 64) if constant >= 1 << 63 else constant


_GOLDEN_GAMMA = _int64(0x9E3779B97F4A7C15)
_MIX_1 = _int64(0xBF58476D1CE4E5B9)
_MIX_2 = _int64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def seeded_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """One uniform draw in [0, 1) per row, from that row's (seed, counter) alone: float64 [B].

    splitmix64, counter-based: draw n of a sequence is the mix of seed + n·γ. torch has no
    per-row seeded generator for a batch (one torch.Generator per row meant a Python loop and one
    kernel per row each step); this is a few vectorised integer ops, and the same on every device.
    int64 multiplication wraps modulo 2^64, which is the arithmetic splitmix64 is defined in.
    These values are the seed contract (docs/batch-invariance.md): changing them breaks every seed
    a client recorded.
    """
    x = seed + counter * _GOLDEN_GAMMA  # [B] int64
    x = (x ^ _shift_right(x, 30)) * _MIX_1
    x = (x ^ _shift_right(x, 27)) * _MIX_2
    x = x ^ _shift_right(x, 31)
    return _shift_right(x, 11).double() * 2.0**-53  # the top 53 bits: a double in [0, 1)


def sample_rows(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [B, V] by inverting its CDF at uniform [B].

    One uniform per row (not one per vocabulary entry) is all a categorical draw needs. The CDF
    is summed in float64 so even a 1e-9 token keeps its share; a token of probability 0 (filtered
    by top-k/top-p) is never chosen, since the search looks for the first CDF value above the target.
    """
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]
    # u * total can round up to total itself; stay strictly below it.
    target = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # [B, 1]
    # A row with no finite probability (NaN, or nothing left) finds no CDF value above its
    # target: the search answers V, which would index past every [B, V] table the step writes
    # (on CUDA a device assert that ends the process). Such a row's token is in range and
    # meaningless; its request fails on its NaN log-probability (service/engine/faults.py).
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)  # [B]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per row.

    log_softmax runs one kernel per row; logsumexp's sum over a lone row is split across CPU
    threads and rounds differently from the same row in a batch.
    """
    return logits.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1)  # [B]


def choose_tokens(
    logits: torch.Tensor,
    params: SamplingTensors,
    counter: torch.Tensor,
    seen: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of every row and its log-probability under the model's own distribution.

    logits [B, V] (any float dtype; computed in float32); counter [B] int64, which draw of its
    sequence each row makes (its length so far); seen [B, V] bool, needed when a row has a
    repetition penalty. The log-probability is of the raw model output, before penalty,
    temperature and filtering: what the model thinks of the token, as OpenAI-style APIs report.
    """
    logits = logits.float()  # [B, V]
    scores = logits
    controls = params.controls
    if controls is not None and controls.bias is not None:
        scores = scores + controls.bias  # transformers' sequence_bias comes first
    if params.any_penalty:
        if seen is None:
            raise ValueError("a repetition penalty needs the seen-token mask")
        scores = apply_repetition_penalty(scores, seen, params.repetition_penalty)
    if controls is not None:
        scores = apply_controls(scores, controls)
    tokens = scores.argmax(dim=-1)  # [B]
    if params.any_sample:
        scores = apply_temperature(scores, params.temperature)
        if params.any_top_k_top_p:
            scores = apply_top_k_top_p(scores, params.top_k, params.top_p)
        if controls is not None:
            scores = apply_warpers(scores, controls)
        sampled = sample_rows(scores.softmax(dim=-1), seeded_uniform(params.seed, counter))  # [B]
        tokens = torch.where(params.do_sample, sampled, tokens)
    return tokens, token_logprobs(logits, tokens)
