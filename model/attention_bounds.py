"""The bounds /analyze/spectrum reports beside each measured ‖A‖₂, and the weight spectra they use.

Notation and derivations: docs/analysis.md ("Bounds"). For a causal, row-stochastic attention
matrix A of n tokens:
    lower = 1 ≤ ‖A‖₂ ≤ colsum = sqrt(max column sum) ≤ trivial = sqrt(n), and
    ‖A‖₂ ≤ prenorm = sqrt(Σ_{i<n} 1 / (1 + i·e^{−2M})), M a bound on |logit| from the weights.
seed_prenorm is the source document's formula; it is reported for comparison and is not a bound
for GPT-2 (it drops the LayerNorm shift and the biases and scales by sqrt(d), not sqrt(d_h)).
M needs a bound on the norm of the attention's input: the LayerNorm in front of it (GPT-2's ln_1;
in a Post-LN model the previous block's ln_2), or for a Post-LN model's first layer, which reads
the embeddings directly, the largest token plus the largest position embedding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torch import nn

from model.gpt2 import GPT2
from model.post_ln import PostLNGPT


@dataclass(frozen=True)
class WeightSpectra:
    """Spectral norms of one model's weights, float64. Per head: [n_layer, n_head]; per layer: [n_layer]."""

    query: torch.Tensor  # ‖W_Q^h‖₂
    key: torch.Tensor  # ‖W_K^h‖₂
    value: torch.Tensor  # ‖W_V^h‖₂
    query_bias: torch.Tensor  # ‖b_Q^h‖₂
    key_bias: torch.Tensor  # ‖b_K^h‖₂
    attn_proj: torch.Tensor  # ‖W_O‖₂ (attn.c_proj)
    mlp_fc: torch.Tensor  # ‖W_fc‖₂
    mlp_proj: torch.Tensor  # ‖W_proj‖₂
    input_gain_max: torch.Tensor  # Γ = max |γ| of the LayerNorm feeding the attention
    input_shift_norm: torch.Tensor  # ‖β‖₂ of that LayerNorm
    input_radius: torch.Tensor  # R ≥ ‖attention input‖₂ of any token: Γ·sqrt(d) + ‖β‖₂
    logit_bound: torch.Tensor  # M = q_max·k_max × the layer's scale (GPT-2's: 1/sqrt(d_h)), per head
    seed_logit_bound: torch.Tensor  # the document's M' = Γ²·‖W_Q^h‖₂·‖W_K^h‖₂·sqrt(d), per head

    def to_dict(self) -> dict:
        return {name: getattr(self, name).tolist() for name in self.__dataclass_fields__}


def weight_spectra(model: GPT2 | PostLNGPT, weight_of: Callable[[nn.Module], torch.Tensor] | None = None) -> WeightSpectra:
    """Every weight-only quantity of docs/analysis.md, in float64 (computed once per model).
    `weight_of`: each Conv1D's [in, out] weight as analysed (a LoRA adapter's merged one); default its own."""
    weight_of = weight_of or (lambda module: module.weight)
    config = model.config
    d, heads, d_h = config.n_embd, config.n_head, config.head_dim
    per_head: dict[str, list[torch.Tensor]] = {k: [] for k in ("q", "k", "v", "bq", "bk")}
    for block in model.h:
        weight = weight_of(block.attn.c_attn).detach().double().cpu()  # [d, 3d], stored [in, out]
        bias = block.attn.c_attn.bias.detach().double().cpu()  # [3d]
        for name, part in zip("qkv", weight.split(d, dim=1)):  # 3 × [d, d]
            per_head_part = part.reshape(d, heads, d_h).transpose(0, 1)  # [H, d, d_h]
            per_head[name].append(_spectral_norms(per_head_part))
        for name, part in zip(("bq", "bk"), bias.split(d)[:2]):
            per_head[name].append(part.reshape(heads, d_h).norm(dim=-1))  # [H]
    q, k, v, bq, bk = (torch.stack(per_head[name]) for name in ("q", "k", "v", "bq", "bk"))  # [L, H]
    # One batched call per kind of per-layer matrix, each stacked [L, r, c].
    o, fc, proj = (
        _spectral_norms(torch.stack([weight_of(block.get_submodule(module)).detach().double().cpu() for block in model.h]))
        for module in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )  # [L] each
    gamma, beta, radius = attention_input_bounds(model)  # [L] each
    # Each layer's own scale: 1/sqrt(d_h) for GPT-2, other values under scale_attn_* options.
    scales = torch.tensor([block.attn.attend.scale_for(d_h) for block in model.h], dtype=torch.float64)  # [L]
    logit_bound = (q * radius[:, None] + bq) * (k * radius[:, None] + bk) * scales[:, None]  # [L, H]
    seed_logit_bound = gamma[:, None] ** 2 * q * k * math.sqrt(d)  # [L, H]
    return WeightSpectra(
        query=q, key=k, value=v, query_bias=bq, key_bias=bk,
        attn_proj=o, mlp_fc=fc, mlp_proj=proj, input_gain_max=gamma, input_shift_norm=beta, input_radius=radius,
        logit_bound=logit_bound, seed_logit_bound=seed_logit_bound,
    )


def attention_input_bounds(model: GPT2 | PostLNGPT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per layer, float64 [L] each: Γ and ‖β‖₂ of the LayerNorm the attention reads, and R.

    ‖LN(x)‖₂ ≤ Γ·sqrt(d) + ‖β‖₂, because the normalised x has norm at most sqrt(d). A Post-LN
    model's first attention reads embeddings: R = max‖token row‖ + max‖position row‖, and Γ is
    reported as R / sqrt(d) (β = 0), the gain a LayerNorm would need for the same radius.
    """
    d = model.config.n_embd
    if isinstance(model, PostLNGPT):
        norms: list[nn.LayerNorm | None] = [None] + [block.ln_2 for block in model.h[:-1]]
    else:
        norms = [block.ln_1 for block in model.h]
    gains, shifts = [], []
    for norm in norms:
        if norm is None:
            tokens = model.tokens_embed.weight.detach().double().norm(dim=-1).max()
            positions = model.positions_embed.weight.detach().double().norm(dim=-1).max()
            gains.append(((tokens + positions) / math.sqrt(d)).cpu())
            shifts.append(torch.zeros((), dtype=torch.float64))
        else:
            gains.append(norm.weight.detach().double().abs().max().cpu())
            shifts.append(norm.bias.detach().double().norm().cpu())
    gamma, beta = torch.stack(gains), torch.stack(shifts)  # [L]
    return gamma, beta, gamma * math.sqrt(d) + beta


def column_sum_bound(column_sums: torch.Tensor) -> torch.Tensor:
    """sqrt(max column sum) per matrix, from column sums [..., n]: ‖A‖₂² ≤ ‖A‖₁·‖A‖_∞ = c_max·1."""
    return column_sums.amax(dim=-1).sqrt()


def prenorm_bound(n_tokens: int, logit_bound: torch.Tensor) -> torch.Tensor:
    """sqrt(Σ_{i<n} 1 / (1 + i·e^{−2M})) for each M of `logit_bound`, float64.

    Row i of a causal matrix has i + 1 entries whose logits differ by at most 2M, so no entry of
    it exceeds 1 / (1 + i·e^{−2M}); summing over rows bounds every column sum.
    """
    rows = torch.arange(n_tokens, dtype=torch.float64)  # [n]
    spread = torch.exp(-2 * logit_bound.double())[..., None]  # [..., 1]
    return (1.0 / (1.0 + rows * spread)).sum(dim=-1).sqrt()  # [...]


def seed_prenorm(n_tokens: int, seed_logit_bound: torch.Tensor) -> torch.Tensor:
    """The document's sqrt(n / (1 + (n−1)·e^{−2M'})); not a valid bound for GPT-2 (see module doc)."""
    spread = torch.exp(-2 * seed_logit_bound.double())
    return (n_tokens / (1.0 + (n_tokens - 1) * spread)).sqrt()


def _spectral_norms(matrices: torch.Tensor) -> torch.Tensor:
    """‖W‖₂ of each [..., r, c] matrix as sqrt(λ_max) of its Gram matrix on the smaller side.

    A symmetric eigenvalue problem of at most 768² runs about 10x faster on CPU than the SVD of
    a 768 × 3072 MLP weight; in float64 the square root loses nothing that matters here.
    """
    gram = matrices.mT @ matrices if matrices.shape[-1] <= matrices.shape[-2] else matrices @ matrices.mT  # [..., k, k]
    return torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0).sqrt()
