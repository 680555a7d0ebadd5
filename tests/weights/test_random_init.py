"""The random-init weights follow GPT-2's initialisation and depend only on the seed (issue 2)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from model.config import GPT2Config
from weights.bpe_source import sha256
from weights.random_init import init_state, write_model_dir

# Wide enough that every weight has >= 16k samples: the sample std is then within ~0.6% (1 sigma).
CONFIG = GPT2Config(vocab_size=1000, n_positions=256, n_embd=128, n_layer=4, n_head=4)
STD = 0.02  # GPT-2's initializer_range
RESIDUAL_STD = STD / math.sqrt(2 * CONFIG.n_layer)  # GPT-2 paper: residual projections scaled


@pytest.fixture(scope="module")
def state():
    return init_state(CONFIG, seed=0)


def expected_init(name: str) -> tuple[str, float]:
    """What GPT-2's init gives a parameter, from its name alone: ("const", c) or ("normal", std)."""
    if re.fullmatch(r"(h\.\d+\.ln_[12]|ln_f)\.(weight|bias)", name):
        return ("const", 1.0 if name.endswith("weight") else 0.0)
    if name.endswith("bias"):
        return ("const", 0.0)
    return ("normal", RESIDUAL_STD if name.endswith("c_proj.weight") else STD)


def test_every_parameter_follows_gpt2_init(state):
    kinds = {}
    for name, tensor in state.items():
        kind, value = expected_init(name)
        kinds.setdefault(kind, []).append(name)
        if kind == "const":
            assert torch.all(tensor == value), name
            continue
        n = tensor.numel()
        assert n >= 16_384, name
        assert abs(tensor.std().item() / value - 1) < 0.05, f"{name}: std {tensor.std():.5f} vs {value:.5f}"
        assert abs(tensor.mean().item()) < 5 * value / math.sqrt(n), f"{name}: mean {tensor.mean():.2e}"
        # Normal, not just the right spread: 68.3% within one std (uniform would give 57.7%).
        within = (tensor.abs() < value).float().mean().item()
        assert abs(within - 0.6827) < 0.02, f"{name}: {within:.3f} within one std"
    # Every kind of parameter is present, so each rule above was exercised.
    assert {"h.0.ln_1.weight", "ln_f.bias", "h.3.attn.c_attn.bias"} <= set(kinds["const"])
    assert {"wte.weight", "wpe.weight", "h.0.attn.c_proj.weight", "h.1.mlp.c_fc.weight"} <= set(
        kinds["normal"]
    )


def test_same_seed_same_weights_other_seed_other_weights(state):
    again = init_state(CONFIG, seed=0)
    other = init_state(CONFIG, seed=1)
    assert state.keys() == again.keys() == other.keys()
    for name in state:
        assert torch.equal(state[name], again[name]), name
        if expected_init(name)[0] == "normal":
            assert not torch.equal(state[name], other[name]), name


def test_written_file_is_byte_identical_for_a_seed(tmp_path):
    small = CONFIG.with_(n_embd=32, n_layer=2)
    first = write_model_dir(tmp_path / "a", small, init_state(small, seed=7))
    second = write_model_dir(tmp_path / "b", small, init_state(small, seed=7))
    assert sha256((first / "model.safetensors").read_bytes()) == sha256(
        (second / "model.safetensors").read_bytes()
    )
