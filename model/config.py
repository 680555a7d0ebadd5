"""GPT-2 hyper-parameters, read from a Hugging Face `config.json` or a preset name."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from model.activations import activation_problem

# The dtypes a model may run in, by the names settings and command lines use.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # None means 4 * n_embd, as in Hugging Face
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    initializer_range: float = 0.02
    # The attention options transformers' GPT2Config offers (model/attention.py computes them).
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    reorder_and_upcast_attn: bool = False
    bos_token_id: int = 50256
    eos_token_id: int = 50256

    def __post_init__(self) -> None:
        # A float or a string here would only fail later, deep inside module construction.
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            if not _is_positive(getattr(self, name), int):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.n_inner is not None and not _is_positive(self.n_inner, int):
            raise ValueError(f"n_inner must be null or a positive integer, got {self.n_inner!r}")
        if not _is_positive(self.layer_norm_epsilon, (int, float)):
            raise ValueError(f"layer_norm_epsilon must be a positive number, got {self.layer_norm_epsilon!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        problem = activation_problem(self.activation_function)
        if problem is not None:
            raise ValueError(problem)
        for name in ATTENTION_OPTIONS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def inner_dim(self) -> int:
        return self.n_inner or 4 * self.n_embd

    @classmethod
    def from_dict(cls, raw: dict) -> "GPT2Config":
        for key, gpt2_value in UNSUPPORTED_OPTIONS.items():
            if raw.get(key, gpt2_value) != gpt2_value:
                raise ValueError(
                    f"{key}={raw[key]!r} changes the model's arithmetic and is not supported"
                    f" (GPT-2 uses {gpt2_value!r})"
                )
        known = {f.name for f in fields(cls)}
        # Hugging Face configs carry many unrelated keys (task params, architectures, ...).
        return cls(**{k: v for k, v in raw.items() if k in known})

    @classmethod
    def from_json(cls, path: str | Path) -> "GPT2Config":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read model config {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise ValueError(f"{path}: model_type is {model_type!r}, expected 'gpt2'")
        try:
            return cls.from_dict(raw)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    @classmethod
    def preset(cls, name: str) -> "GPT2Config":
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None

    def to_hf_dict(self, dtype: str | None = None) -> dict:
        """config.json as transformers writes it for GPT2LMHeadModel: every key of its
        `GPT2Config(...).to_dict()` (tests/weights/test_config_file.py compares them), without
        `transformers_version` (transformers did not write the file), plus `n_ctx`, which the
        hub's GPT-2 configs carry and llama.cpp's converter reads. `dtype`: the tensors' dtype."""
        return {
            **asdict(self),
            **GPT2_OPTIONS,
            **UNSUPPORTED_OPTIONS,
            **HF_CONFIG_DEFAULTS,
            "n_ctx": self.n_positions,
            "dtype": dtype,
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
        }

    def with_(self, **changes) -> "GPT2Config":
        return replace(self, **changes)


def _is_positive(value: object, kind: type | tuple[type, ...]) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool) and value > 0


ATTENTION_OPTIONS = ("scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn")

# transformers' GPT2Config options that this implementation does not compute, with the value
# GPT-2 itself uses: a config that sets another value must be refused, not silently served.
UNSUPPORTED_OPTIONS = {
    "add_cross_attention": False,
}

# Options for training and for heads this project does not build, at their defaults: GPT-1's
# and GPT-2's configs both carry these, GPT-2's the two after them too.
TRAINING_AND_HEAD_OPTIONS = {
    "resid_pdrop": 0.1,
    "embd_pdrop": 0.1,
    "attn_pdrop": 0.1,
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "summary_activation": None,
    "summary_proj_to_labels": True,
    "summary_first_dropout": 0.1,
}
GPT2_OPTIONS = {**TRAINING_AND_HEAD_OPTIONS, "use_cache": True}

# The keys transformers' PretrainedConfig.to_dict() adds to every model's config, at their defaults.
HF_CONFIG_DEFAULTS = {
    "_name_or_path": "",
    "output_hidden_states": False,
    "output_attentions": False,
    "return_dict": True,
    "chunk_size_feed_forward": 0,
    "is_encoder_decoder": False,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
    "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    "problem_type": None,
    "pad_token_id": None,
    "tie_word_embeddings": True,
}

PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(),
    "gpt2-medium": GPT2Config(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": GPT2Config(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": GPT2Config(n_embd=1600, n_layer=48, n_head=25),
    "distilgpt2": GPT2Config(n_layer=6),
}
