"""transformers' GPT2LMHeadModel as the reference the model tests compare against."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GPT2LMHeadModel

from model.config import GPT2Config
from model.gpt2 import GPT2

# fp32 logits of two implementations of the same arithmetic, summed in different orders.
LOGIT_TOLERANCE = 1e-4


def load_reference(model_dir: Path, config: GPT2Config) -> GPT2LMHeadModel:
    """The folder read by transformers in float32, with the checks that it really read it."""
    reference, info = GPT2LMHeadModel.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    # A weight transformers did not find would be silently random-initialised.
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    hf = reference.config
    read = (hf.n_layer, hf.n_embd, hf.n_head, hf.n_positions, hf.n_inner, hf.layer_norm_epsilon)
    wanted = (config.n_layer, config.n_embd, config.n_head, config.n_positions, config.n_inner,
              config.layer_norm_epsilon)
    assert read == wanted
    assert reference.lm_head.weight is reference.transformer.wte.weight  # tied, as GPT-2
    return reference.eval()


def random_ids(config: GPT2Config, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length), generator=generator)  # [B, T]


@torch.no_grad()
def max_logit_diff(ours: GPT2, reference: GPT2LMHeadModel, ids: torch.Tensor) -> float:
    expected = reference(ids).logits  # [B, T, V]
    actual = ours(ids).logits  # [B, T, V]
    assert actual.shape == expected.shape
    return (actual.float() - expected).abs().max().item()
