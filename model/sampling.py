"""Choosing the next token: pure functions over [batch, vocab] logits with per-row parameters.

Every parameter is a tensor with one entry per row, so one call serves a batch that mixes
greedy and sampled rows with different temperatures, top-k, top-p and repetition penalties.
The semantics are those of transformers' logits processors, applied in generate()'s order:
repetition penalty, then (sampling only) temperature, top-k, top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    any_sample: bool
    any_top_k_top_p: bool
    any_penalty: bool


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
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=False)  # [B, V] ascending
    # The k-th largest value sits at ascending index V - k.
    kth_index = (vocab - top_k.clamp(1, vocab))[:, None]  # [B, 1]
    kth_largest = sorted_logits.gather(1, kth_index)  # [B, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    outside_nucleus = cumulative <= (1 - top_p)[:, None]  # [B, V]
    outside_nucleus[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(outside_nucleus, float("-inf"))
    return sorted_logits.scatter(1, sorted_index, sorted_logits)  # [B, V] original order


def sample_rows(
    probs: torch.Tensor, generators: list[torch.Generator | None]
) -> torch.Tensor:
    """One token per row drawn from probs [B, V], each row from its own generator.

    argmax(p / q) with q ~ Exp(1) is a draw from p (the exponential race). Each row's noise comes
    only from its own generator, so a seeded sequence draws the same tokens whatever else is in
    the batch. Rows whose generator is None are not drawn (their result is meaningless).
    """
    noise = torch.ones_like(probs)  # [B, V]
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    # Exp(1) can return 0 in float32; the clamp avoids 0/0 and changes nothing measurable.
    return (probs / noise.clamp_min_(1e-30)).argmax(dim=-1)  # [B]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per row, without materialising the [B, V] log-softmax."""
    chosen = logits.gather(1, tokens[:, None]).squeeze(1)  # [B]
    return chosen - logits.logsumexp(dim=-1)


def choose_tokens(
    logits: torch.Tensor,
    params: SamplingTensors,
    generators: list[torch.Generator | None],
    seen: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of every row and its log-probability under the model's own distribution.

    logits [B, V] (any float dtype; computed in float32); seen [B, V] bool, needed when a row
    has a repetition penalty. The log-probability is of the raw model output, before penalty,
    temperature and filtering: what the model thinks of the token, as OpenAI-style APIs report.
    """
    logits = logits.float()  # [B, V]
    scores = logits
    if params.any_penalty:
        if seen is None:
            raise ValueError("a repetition penalty needs the seen-token mask")
        scores = apply_repetition_penalty(scores, seen, params.repetition_penalty)
    tokens = scores.argmax(dim=-1)  # [B]
    if params.any_sample:
        scores = apply_temperature(scores, params.temperature)
        if params.any_top_k_top_p:
            scores = apply_top_k_top_p(scores, params.top_k, params.top_p)
        sampled = sample_rows(scores.softmax(dim=-1), generators)  # [B]
        tokens = torch.where(params.do_sample, sampled, tokens)
    return tokens, token_logprobs(logits, tokens)
