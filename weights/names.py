"""How checkpoint tensor names map onto our module names, as data.

Hugging Face GPT-2 checkpoints name tensors like our modules, with or without a `transformer.`
prefix; some carry non-parameter buffers and a copy of the tied LM head.
"""

from __future__ import annotations

import re

PREFIXES = ("transformer.",)

# Buffers older transformers versions saved (causal mask, masked-score constant): not weights.
IGNORED = (re.compile(r"h\.\d+\.attn\.(bias|masked_bias)"),)

# Tensors that must equal another one because the weights are tied.
TIED = {"lm_head.weight": "wte.weight"}


def canonical_name(checkpoint_name: str) -> str:
    for prefix in PREFIXES:
        if checkpoint_name.startswith(prefix):
            return checkpoint_name[len(prefix):]
    return checkpoint_name


def is_ignored(name: str) -> bool:
    return any(pattern.fullmatch(name) for pattern in IGNORED)


def hf_name(name: str) -> str:
    """The name transformers' GPT2LMHeadModel saves a parameter under."""
    return f"transformer.{name}"
