"""Preset sizes equal transformers' GPT-2 built from the same config (issue 2)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config as HFGPT2Config
from transformers import GPT2LMHeadModel

from model.config import PRESETS
from model.gpt2 import GPT2


def unique_parameter_count(module: torch.nn.Module) -> int:
    # parameters() yields a shared tensor once, so the tied head counts once.
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2"])
def test_preset_parameter_count_equals_transformers(name):
    config = PRESETS[name]
    with torch.device("meta"):
        ours = GPT2(config)
        reference = GPT2LMHeadModel(HFGPT2Config(**config.to_hf_dict()))
    assert reference.lm_head.weight is reference.transformer.wte.weight
    assert reference.config.n_layer == config.n_layer and reference.config.n_embd == config.n_embd
    assert unique_parameter_count(ours) == unique_parameter_count(reference)
    # Same tensors by name and shape, not only the same total.
    ours_shapes = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    reference_shapes = {
        n.removeprefix("transformer."): tuple(p.shape) for n, p in reference.named_parameters()
    }
    assert ours_shapes == reference_shapes


def test_distilgpt2_is_gpt2_with_six_layers():
    assert PRESETS["distilgpt2"] == PRESETS["gpt2"].with_(n_layer=6)
