"""A deterministic random-init GPT-2 with GPT-2's initialisation, written in the HF layout."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from model.config import GPT2Config
from model.gpt2 import GPT2
from weights.checkpoint import CONFIG_FILE, SINGLE_FILE
from weights.names import hf_name


def init_state(
    config: GPT2Config,
    seed: int = 0,
    progress: bool = False,
    model_class: type[nn.Module] = GPT2,
    scale_residual: bool = True,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """GPT-2's initialisation (transformers' GPT2PreTrainedModel._init_weights), seeded.

    Weights and embeddings ~ N(0, 0.02); residual projections (attn.c_proj, mlp.c_proj) scaled
    by 1/sqrt(2·n_layer) when `scale_residual` (GPT-1's init does not); biases 0; LayerNorm
    gain 1, shift 0. The same seed and config give the same tensors on every machine (CPU
    generator, fixed parameter order). `model_class(config)` names the parameters. `device`:
    drawn there by its own generator instead (a 1.5B model in seconds on a GPU, minutes on a
    host's CPU; the same tensors from one machine to another of that kind only).
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in model_class(config).named_parameters()}
    residual_std = config.initializer_range / (math.sqrt(2 * config.n_layer) if scale_residual else 1.0)
    state = {}
    for name, shape in tqdm(shapes.items(), desc="random init", disable=not progress):
        leaf = name.rsplit(".", 1)[-1]
        if ".ln_" in f".{name}":
            state[name] = torch.ones(shape, device=device) if leaf == "weight" else torch.zeros(shape, device=device)
        elif leaf == "bias":
            state[name] = torch.zeros(shape, device=device)
        else:
            std = residual_std if name.endswith("c_proj.weight") else config.initializer_range
            state[name] = torch.randn(shape, generator=generator, device=device) * std
    return state


def write_model_dir(
    out_dir: Path,
    config: GPT2Config,
    state: dict[str, torch.Tensor],
    prefixed: bool = True,
    dtype: torch.dtype = torch.float32,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """config.json + model.safetensors; `prefixed` chooses `transformer.` names (as
    transformers saves GPT2LMHeadModel) or bare names (as the hub's openai-community/gpt2 has)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        (hf_name(name) if prefixed else name): t.to(dtype).contiguous() for name, t in state.items()
    }
    tensors.update(extra_tensors or {})
    save_file(tensors, str(out_dir / SINGLE_FILE), metadata={"format": "pt"})
    config_dict = config.to_hf_dict(dtype=str(dtype).removeprefix("torch."))
    (out_dir / CONFIG_FILE).write_text(json.dumps(config_dict, indent=2) + "\n")
    return out_dir
