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
