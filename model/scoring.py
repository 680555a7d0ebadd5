"""Log-probabilities of chosen tokens, their ranks and each row's top-N alternatives.

Pure functions over [rows, vocab] logits, shared by the sampler (generated tokens) and the
prompt scorer (prompt tokens). Everything is derived from the logits and one logsumexp per row,
so no [rows, vocab] log-softmax is materialised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Scores:
    logprobs: torch.Tensor  # [B] log p(chosen token)
    ranks: torch.Tensor  # [B] long: 1 + how many tokens are strictly more likely (vLLM's rank)
    top_ids: torch.Tensor  # [B, n] long, most likely first
    top_logprobs: torch.Tensor  # [B, n]


def score_tokens(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> Scores:
    """logits [B, V] (float32), tokens [B], n >= 0 alternatives per row."""
    normaliser = logits.logsumexp(dim=-1, keepdim=True)  # [B, 1]
    chosen = logits.gather(1, tokens[:, None])  # [B, 1]
    # Comparing logits orders tokens as comparing their log-probabilities would.
    ranks = (logits > chosen).sum(dim=-1) + 1  # [B]
    top_values, top_ids = logits.topk(n, dim=-1)  # [B, n]
    return Scores((chosen - normaliser).squeeze(1), ranks, top_ids, top_values - normaliser)


def top_alternatives(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n most likely tokens of each row and their log-probabilities: [B, n] ids, [B, n]."""
    values, ids = logits.topk(n, dim=-1)  # [B, n]
    return ids, values - logits.logsumexp(dim=-1, keepdim=True)
