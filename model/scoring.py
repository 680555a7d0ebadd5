"""Log-probabilities of chosen tokens, their ranks and each row's top-N alternatives.

Pure functions over [rows, vocab] logits, shared by the sampler (generated tokens) and the
prompt scorer (prompt tokens). Log-probabilities come from log_softmax, a kernel per row:
logsumexp splits a lone row's sum across threads, so a row scored alone (a prompt's chunk of one
position) would round otherwise than the same row among others (docs/batch-invariance.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class Scores:
    logprobs: torch.Tensor  # [B] log p(chosen token)
    ranks: torch.Tensor  # [B] long: 1 + how many tokens are strictly more likely (vLLM's rank)
    top_ids: torch.Tensor  # [B, n] long, most likely first
    top_logprobs: torch.Tensor  # [B, n]


def score_tokens(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> Scores:
    """logits [B, V] (float32), tokens [B], n >= 0 alternatives per row. Ranks and alternatives
    order tokens by the log-probabilities reported (as vLLM does), not by the logits: two logits
    apart can round to one log-probability, and then the lower id comes first."""
    log_probs = logits.log_softmax(dim=-1)  # [B, V]
    chosen = log_probs.gather(1, tokens[:, None])  # [B, 1]
    ranks = (log_probs > chosen).sum(dim=-1) + 1  # [B]
    top_ids, top_logprobs = most_likely(log_probs, n)  # [B, n]
    return Scores(chosen.squeeze(1), ranks, top_ids, top_logprobs)


def top_alternatives(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n most likely tokens of each row and their log-probabilities: [B, n] ids, [B, n].

    The sampler's rows share one call: log_softmax is a kernel per row, where logsumexp's sum
    over a lone row is split across threads and rounds differently from the same row in a batch.
    """
    return most_likely(logits.log_softmax(dim=-1), n)


def most_likely(log_probs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n highest log-probabilities of each row [B, V], highest first, equal ones lowest id
    first: [B, n] ids, [B, n] values."""
    if n == 0:
        return torch.zeros(log_probs.shape[0], 0, dtype=torch.long, device=log_probs.device), log_probs[:, :0]
    values, ids = top_nonpositive(log_probs, n)
    return ids, values


def top_n(values: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest of each row [B, V], largest first, equal values lowest index first: [B, n]
    values and [B, n] indices.

    torch.topk leaves the order of equal values to its algorithm, which changes with n, the
    device and the shape: a row asking for 2 alternatives beside one asking for 5 (the call takes
    the batch's largest n) would get other ids than alone. Here the n-th largest value (which
    topk does define) sets the cut-off, and the places it leaves go to the lowest indices.
    """
    if n == 0:
        return values[:, :0], torch.zeros(values.shape[0], 0, dtype=torch.long, device=values.device)
    cutoff = values.topk(n, dim=-1).values[:, -1:]  # [B, 1]
    above = values > cutoff  # [B, V]
    tied = values == cutoff
    room = n - above.sum(dim=-1, keepdim=True)  # [B, 1] places left for the tied values
    chosen = above | (tied & (tied.cumsum(dim=-1) <= room))  # [B, V], exactly n per row
    # The chosen indices, lowest first: a top-n over distinct keys (no device sync, unlike nonzero).
    vocab = values.shape[-1]
    keys = torch.where(chosen, vocab - torch.arange(vocab, device=values.device), 0)  # [B, V]
    ids = keys.topk(n, dim=-1).indices.sort(dim=-1).values  # [B, n] ascending
    chosen_values = values.gather(1, ids)
    order = chosen_values.sort(dim=-1, descending=True, stable=True).indices  # ties keep the lower id first
    return chosen_values.gather(1, order), ids.gather(1, order)


def top_nonpositive(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of float32 values never above 0 (log-probabilities and their
    sums, -inf included; a NaN ranks last), contiguous [B, W], k >= 1: [B, k] values and [B, k]
    indices, largest first, equal values lowest index first, -0.0 equal to 0.0.

    torch.topk alone leaves the order of equal values to its algorithm, which changes with k, the
    device and the shape: a row asking for 2 alternatives beside one asking for 5 would get other
    ids than alone. This is one top-k over distinct int64 keys, in 7 operations (a beam search's
    candidates are found every step it runs, alternatives every step a row asks for them). A
    value at most 0 has its sign bit set, but for 0.0, which is given it: its bits, as a signed
    integer, then grow as the value falls, so the smallest key is the largest value, and its
    index, below them, unreversed, puts equal values lowest index first."""
    # The bits, sign-extended, shifted into the high half; the low half, the index, comes with the
    # sign bit of the high half's 32-bit value, which 0.0 lacks (the others have it already).
    keys = values.view(torch.int32).long().bitwise_left_shift_(32)
    keys.bitwise_or_(signed_index(values.shape[-1], values.device))
    index = keys.topk(k, dim=-1, largest=False).values.bitwise_and_(0xFFFFFFFF)  # [B, k]
    return values.gather(1, index), index


@functools.cache
def signed_index(width: int, device: torch.device) -> torch.Tensor:
    """[W] int64: i with bit 63 set, at i (made once per width and device: read only)."""
    return torch.arange(width, device=device).bitwise_or_(-(1 << 63))
