"""Small random GPT-2-architecture checkpoints with transformers' GPT2Config options set, and
both implementations' reading of them (tests/model/test_checkpoint_options.py, the CUDA lane's
graph test)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GPT2LMHeadModel

from model.config import GPT2Config
from model.gpt2 import GPT2
from tests.conftest import DEFAULT_MODEL_DIR, TINY, perturbed_state
from weights.checkpoint import build_model, load_model, read_state_dict
from weights.random_init import write_model_dir

# Three layers, so 1/(layer_index + 1) takes three values.
BASE = GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=3, n_head=2)

CASES: dict[str, GPT2Config] = {
    # Cerebras-GPT: exact GELU, 2,048 positions, n_inner written out.
    "cerebras-gelu-2048": BASE.with_(activation_function="gelu", n_positions=2048, n_inner=128),
    "inverse-layer-scale": BASE.with_(scale_attn_by_inverse_layer_idx=True),
    "reorder-and-upcast": BASE.with_(reorder_and_upcast_attn=True),
    # Stanford CRFM's GPT-2 models set both.
    "crfm-both": BASE.with_(scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True),
    "unscaled": BASE.with_(scale_attn_weights=False),
    "unscaled-inverse-layer": BASE.with_(scale_attn_weights=False, scale_attn_by_inverse_layer_idx=True),
    # Everything at once, with a head size of 9 (no fused CUDA kernel takes it) and GPT-2's options
    # that are shapes rather than switches.
    "everything": GPT2Config(
        vocab_size=300, n_positions=128, n_embd=36, n_layer=3, n_head=4, n_inner=80, layer_norm_epsilon=1e-3,
        activation_function="gelu_fast", scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True,
    ),
}
# What the engine tests serve from a folder: the real vocabulary (the engine detokenizes), exact
# GELU and 2,048 positions (Cerebras-GPT), both of CRFM's attention options.
ENGINE_CASE = TINY.with_(
    n_positions=2048, activation_function="gelu", scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True,
)
# The cases whose float32 logits change when the option is left out (reorder_and_upcast_attn alone
# does not: float32 scores are what a float32 model computes anyway).
SENSITIVE = set(CASES) - {"reorder-and-upcast"}

# GPT-2's initialisation gives small attention scores, MLP inputs and logits (~0.4), where the
# options move the logits by less than the tolerance (the exact GELU differs from the tanh one
# by at most 5e-4); these gains make every option show far above it.
QUERY_KEY_GAIN = 8.0
MLP_GAIN = 20.0
LOGIT_GAIN = 30.0  # on the final LayerNorm: logits ~13

GPT2_ARITHMETIC = {"activation_function": "gelu_new", "scale_attn_weights": True,
                   "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}


def write_options_model(folder: Path, config: GPT2Config, seed: int = 0, query_key_gain: float = QUERY_KEY_GAIN) -> Path:
    """A loadable folder (config with its options, weights, GPT-2's tokenizer) for `config`."""
    state = perturbed_state(config, seed)
    C = config.n_embd
    for name, tensor in state.items():
        if name.endswith("attn.c_attn.weight"):
            tensor[:, : 2 * C] *= query_key_gain  # [C, 3C]: the queries' and keys' columns
        elif name.endswith("mlp.c_fc.weight"):
            tensor *= MLP_GAIN
        elif name.startswith("ln_f."):
            tensor *= LOGIT_GAIN
    write_model_dir(folder, config, state)
    if config.vocab_size == TINY.vocab_size:  # the real vocabulary: the tokenizer serves it
        for name in ("tokenizer.json", "vocab.json", "merges.txt"):
            (folder / name).write_bytes((DEFAULT_MODEL_DIR / name).read_bytes())
    return folder


def load_reference(folder: Path, config: GPT2Config, device: torch.device, dtype: torch.dtype) -> GPT2LMHeadModel:
    """transformers' eager GPT-2 (the implementation that computes reorder_and_upcast_attn) on
    the folder, checked to have read every weight and every option."""
    reference, info = GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager", dtype=dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    read = {key: getattr(reference.config, key) for key in GPT2_ARITHMETIC}
    assert read == {key: getattr(config, key) for key in GPT2_ARITHMETIC}
    return reference.to(device).eval()


def load_both(folder: Path, config: GPT2Config, device: torch.device, dtype: torch.dtype = torch.float32):
    """(ours, transformers') on the device, in `dtype`."""
    ours = load_model(folder, device=device, dtype=dtype)
    assert ours.config == config
    return ours, load_reference(folder, config, device, dtype)


def without_options(folder: Path, config: GPT2Config, device: torch.device) -> GPT2:
    """Our model on the same weights with GPT-2's own arithmetic: what ignoring the options serves."""
    plain = config.with_(**GPT2_ARITHMETIC)
    return build_model(GPT2, plain, read_state_dict(folder, plain, torch.float32), device)
