"""transformers' GPT-1 (OpenAIGPT*) as the reference for our Post-LN model: checkpoints with random
weights made here, saved by transformers itself, in both of its layouts."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel, OpenAIGPTModel

from model.post_ln import PostLNConfig

# The tiny GPT-2's shape (tests/conftest.py TINY) with GPT-2's vocabulary, so the same texts work.
TINY_POST_LN = PostLNConfig(vocab_size=50257, n_positions=128, n_embd=64, n_layer=3, n_head=4)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")


def reference_config(config: PostLNConfig = TINY_POST_LN) -> OpenAIGPTConfig:
    return OpenAIGPTConfig(
        vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=config.n_embd,
        n_layer=config.n_layer, n_head=config.n_head, afn=config.afn, layer_norm_epsilon=config.layer_norm_epsilon,
    )


def write_post_ln_checkpoint(
    out_dir: Path, tokenizer_dir: Path, seed: int = 0, qk_scale: float = 1.0, with_head: bool = True
) -> Path:
    """GPT-1 with transformers' init, then random biases and LayerNorms (so a dropped or
    misplaced one shows), query/key weights times `qk_scale`; saved by save_pretrained:
    `transformer.`-prefixed with the LM head (OpenAIGPTLMHeadModel), or bare (OpenAIGPTModel)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = (OpenAIGPTLMHeadModel if with_head else OpenAIGPTModel)(reference_config())
        d = TINY_POST_LN.n_embd
        with torch.no_grad():
            for name, tensor in model.named_parameters():
                if ".ln_" in name:
                    tensor.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
                elif name.endswith("bias"):
                    tensor.normal_(0.0, 0.02)
                if "attn.c_attn" in name:
                    tensor[..., : 2 * d] *= qk_scale  # W_Q, W_K and their biases, not W_V
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out_dir / name)
    return out_dir


def load_post_ln_reference(model_dir: Path) -> OpenAIGPTModel:
    return OpenAIGPTModel.from_pretrained(model_dir, dtype=torch.float32).eval()
