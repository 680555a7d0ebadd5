"""GPT-1 (Post-LN decoder), module names as in Hugging Face's `openai-gpt` checkpoints.

For the attention analysis only (docs/analysis.md, "Pre-LN against Post-LN"): generation stays
GPT-2. The differences from GPT-2 that change the arithmetic: a LayerNorm *after* each residual
addition (x ← LN_1(x + attn(x)), x ← LN_2(x + mlp(x))), no final LayerNorm, and embeddings
named `tokens_embed` / `positions_embed`. The attention (with its probabilities hook) and the MLP
are GPT-2's modules: transformers' GPT-1 "gelu" is the same tanh approximation (`gelu_new`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn

from model.config import HF_CONFIG_DEFAULTS, TRAINING_AND_HEAD_OPTIONS
from model.gpt2 import GPT2, MLP, AttentionInputs, CausalSelfAttention, ForwardOutput, head_output, run_blocks
from model.linear import Conv1D, linear

MODEL_TYPE = "openai-gpt"
# transformers' OpenAIGPTConfig `afn` values computed here (its "gelu" is `gelu_new`); others
# (relu, silu) would be another model.
ACTIVATIONS = ("gelu",)


@dataclass(frozen=True)
class PostLNConfig:
    """OpenAIGPTConfig's hyper-parameters; defaults are GPT-1's (`openai-gpt`)."""

    vocab_size: int = 40478
    n_positions: int = 512
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5
    afn: str = "gelu"
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.afn not in ACTIVATIONS:
            raise ValueError(f"unsupported afn {self.afn!r}; supported: {', '.join(ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def inner_dim(self) -> int:
        return 4 * self.n_embd  # GPT-1 has no n_inner option

    @classmethod
    def from_json(cls, path: str | Path) -> "PostLNConfig":
        raw = json.loads(Path(path).read_text())
        if raw.get("model_type") != MODEL_TYPE:
            raise ValueError(f"{path}: model_type is {raw.get('model_type')!r}, expected {MODEL_TYPE!r}")
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in raw.items() if k in known})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from exc

    @classmethod
    def preset(cls, name: str) -> "PostLNConfig":
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown Post-LN preset {name!r}; known: {', '.join(PRESETS)}") from None

    def to_hf_dict(self, dtype: str | None = None) -> dict:
        """config.json as transformers writes it for OpenAIGPTLMHeadModel: every key of its
        `OpenAIGPTConfig(...).to_dict()` but `transformers_version`, as GPT2Config.to_hf_dict."""
        return asdict(self) | TRAINING_AND_HEAD_OPTIONS | HF_CONFIG_DEFAULTS | {
            "bos_token_id": None, "eos_token_id": None, "dtype": dtype,
            "model_type": MODEL_TYPE, "architectures": ["OpenAIGPTLMHeadModel"],
        }


PRESETS: dict[str, PostLNConfig] = {
    "openai-gpt": PostLNConfig(),
    # GPT-2 124M's shape, vocabulary and context with GPT-1's Post-LN arithmetic: the same texts
    # and token ids go through both, so the two curves differ by the layer-norm placement only.
    "post-ln-gpt2": PostLNConfig(vocab_size=50257, n_positions=1024),
}


class PostLNBlock(nn.Module):
    def __init__(self, config: PostLNConfig, layer_index: int) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_index)
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, ctx: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn_out, probs = self.attn(x, ctx)
        x = self.ln_1(x + attn_out)
        return self.ln_2(x + self.mlp(x)), probs


class PostLNGPT(nn.Module):
    """GPT-1's decoder; `forward` answers what the analysis asks of GPT2.forward."""

    def __init__(self, config: PostLNConfig) -> None:
        super().__init__()
        self.config = config
        self.tokens_embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.positions_embed = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(PostLNBlock(config, i) for i in range(config.n_layer))

    @property
    def device(self) -> torch.device:
        return self.tokens_embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tokens_embed.weight.dtype

    @property
    def tied_embedding(self) -> torch.Tensor:
        """The [V, C] token embedding that is also the LM head."""
        return self.tokens_embed.weight

    def prepare(self, use_packed: bool = True) -> None:
        for module in self.modules():
            if isinstance(module, Conv1D):
                module.prepare(use_packed)

    def forward(
        self,
        input_ids: torch.Tensor,
        logits_index: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        apply_head: bool = True,
    ) -> ForwardOutput:
        """input_ids [B, T] from position 0; no cache (analysis and training). Logits from the
        tied head; apply_head=False returns what the head would read (`head_input`) instead."""
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)  # [B, T]
        ctx = AttentionInputs(
            positions=positions, mask=GPT2._attention_mask(positions, T, cached=False), kv_length=T,
            cache=None, rows=None, want_probs=output_attentions,
        )
        x = self.tokens_embed(input_ids) + self.positions_embed(positions)  # [B, T, C]
        x, hidden, attentions = run_blocks(self.h, x, ctx, output_hidden_states)
        if logits_index is not None:
            x = x[torch.arange(B, device=x.device), logits_index]  # [B, C]
        head = lambda h: linear(h, self.tokens_embed.weight, None, None)  # noqa: E731
        return head_output(x, head, apply_head, attentions, hidden)
