"""How a layer turns queries, keys and values into its output: the scores' scale and precision.

GPT-2 scales q·kᵀ by 1/√d_h, scaled_dot_product_attention's default. Three options of
transformers' GPT2Config change that arithmetic, and `AttentionMath` computes each as
transformers' GPT2Attention does:
- `scale_attn_weights: false`: no 1/√d_h;
- `scale_attn_by_inverse_layer_idx`: a further 1/(layer_index + 1) (Stanford CRFM's models);
- `reorder_and_upcast_attn`: the scores q·kᵀ·scale and their softmax in float32 whatever the
  model's dtype, the probabilities then cast to v's dtype for the product with v (transformers'
  eager `_upcast_and_reordered_attn`). A float32 model computes its scores in float32 anyway, so
  there it changes nothing and SDPA keeps serving; a float16 or bfloat16 model runs the float32
  scores below on every path (batched, row by row, packed, cached decode, CUDA graphs).

`attend_in_blocks`: a CPU prefill's attention in query blocks at fixed positions, so a prompt's
bits do not depend on how it is cut into chunks or how much of it a cached prefix holds
(docs/batch-invariance.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.config import GPT2Config


@dataclass(frozen=True)
class AttentionMath:
    scale: float | None = None  # None: SDPA's default, 1/√d_h (GPT-2's)
    upcast: bool = False  # reorder_and_upcast_attn

    @classmethod
    def for_layer(cls, config: GPT2Config, layer_index: int) -> "AttentionMath":
        """Layer `layer_index`'s arithmetic under `config`'s options."""
        if config.scale_attn_weights and not config.scale_attn_by_inverse_layer_idx:
            # GPT-2's own scale stays SDPA's default, so GPT-2 models keep their bits exactly.
            return cls(upcast=config.reorder_and_upcast_attn)
        # In transformers' order of operations: 1/√d_h (or 1), then divided by the layer number.
        scale = config.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_index + 1)
        return cls(scale=scale, upcast=config.reorder_and_upcast_attn)

    def scale_for(self, head_dim: int) -> float:
        """The factor the scores q·kᵀ are multiplied by."""
        return 1.0 / math.sqrt(head_dim) if self.scale is None else self.scale

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [B, H, T, d_h] over k, v [B, H, L, d_h], mask [B, 1, T, L] (True: visible) or None
        (all visible) -> [B, H, T, d_h]."""
        if self.upcast and q.dtype != torch.float32:
            return upcast_attention(q, k, v, mask, self.scale_for(q.shape[-1]))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)


def float32_scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """(q·kᵀ)·scale in float32, masked positions -inf: [B, H, T, L].

    Scaling q rather than the scores, and masking in place, spares two [B, H, T, L] temporaries
    (~20% of a 1024-token analysis forward); GPT-2's 1/√64 is a power of two, so its scores are
    bit-identical to transformers' (q·kᵀ)/8 all the same."""
    scores = (q.float() * scale) @ k.float().transpose(-2, -1)  # [B, H, T, L]
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return scores


def upcast_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """transformers' `_upcast_and_reordered_attn`: float32 scores and softmax, then the
    probabilities in v's dtype times v. [B, H, T, d_h]."""
    probs = float32_scores(q, k, mask, scale).softmax(dim=-1)  # [B, H, T, L] float32
    return probs.to(v.dtype) @ v


GPT2_ATTENTION = AttentionMath()


# Prefill queries per attention call on CPU (`attend_in_blocks`). Blocks of 16 to 128 prefilled
# GPT-2 124M's 100- to 1000-token prompts within 2% of each other (1 thread, the 2-core AMD EPYC);
# a smaller block computes fewer padding queries at a chunk's ragged ends.
QUERY_BLOCK = 32


def attend_in_blocks(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, attend: AttentionMath,
) -> torch.Tensor:
    """q [1, H, n, d_h], the queries of positions start..start+n-1, over keys and values [1, H, L, d_h]
    -> [1, H, n, d_h].

    Positions a..a+QUERY_BLOCK-1 (a a multiple of QUERY_BLOCK) are one call over the first
    min(a + QUERY_BLOCK, L) keys, each query masked to the keys up to its own: with L the cache's
    length or a whole number of blocks past the row's end (`GPT2.forward_packed`), a call whose
    shape depends on a alone. Positions of the block outside this forward (before a cached
    prefix's end or past the chunk) are zero queries, whose rows a query's arithmetic never reads;
    keys past the chunk are masked (the cache holds finite values there, multiplied by 0)."""
    H, n, d = q.shape[1], q.shape[2], q.shape[3]
    outputs = []
    for a in range(start - start % QUERY_BLOCK, start + n, QUERY_BLOCK):
        low, high = max(a, start), min(a + QUERY_BLOCK, start + n)  # this forward's positions in the block
        length = min(a + QUERY_BLOCK, keys.shape[2])
        block = q[:, :, low - start : high - start]  # [1, H, high - low, d_h]
        if high - low < QUERY_BLOCK:
            block = torch.cat([q.new_zeros(1, H, low - a, d), block, q.new_zeros(1, H, a + QUERY_BLOCK - high, d)], dim=2)
        positions = torch.arange(a, a + QUERY_BLOCK, device=q.device)  # [Q]
        mask = torch.arange(length, device=q.device)[None, :] <= positions[:, None]  # [Q, L]
        y = attend(block, keys[:, :, :length], values[:, :, :length], mask[None, None])  # [1, H, Q, d_h]
        outputs.append(y[:, :, low - a : high - a])
    return torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
