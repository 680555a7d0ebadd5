"""Post-LN (GPT-1) model folders for the analysis: load Hugging Face `openai-gpt` checkpoints,
write a random-init one offline, and load either kind of folder by its config's model_type.

    python -m weights.post_ln --out weights/post-ln-gpt2 [--preset post-ln-gpt2] [--seed 0]

writes GPT-2 124M's shape with Post-LN arithmetic, GPT-2's initialisation scale and the GPT-2
tokenizer of --tokenizer-dir (default weights/gpt2), so the same texts go through both models.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch


from model.gpt2 import GPT2
from model.post_ln import MODEL_TYPE, PRESETS, PostLNConfig, PostLNGPT
from weights.checkpoint import CONFIG_FILE, CheckpointError, build_model, load_model, read_state_dict
from weights.random_init import init_state, write_model_dir

# OpenAIGPTLMHeadModel's head is the token embedding, transposed.
TIED = {"lm_head.weight": "tokens_embed.weight"}
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")

def load_post_ln_model(
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> PostLNGPT:
    model_dir = Path(model_dir)
    try:
        config = PostLNConfig.from_json(model_dir / CONFIG_FILE)
    except (OSError, ValueError) as exc:
        raise CheckpointError(str(exc)) from exc
    state = read_state_dict(model_dir, config, dtype, model_class=PostLNGPT, tied=TIED)
    return build_model(PostLNGPT, config, state, device)

def model_type(model_dir: Path) -> str:
    try:
        return json.loads((model_dir / CONFIG_FILE).read_text()).get("model_type", "gpt2")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{model_dir / CONFIG_FILE}: cannot read the model config ({exc})") from exc

def load_analysis_model(
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> GPT2 | PostLNGPT:
    """A GPT-2 (Pre-LN) or GPT-1 (Post-LN) model, by the folder's config.json model_type."""
    model_dir = Path(model_dir)
    if model_type(model_dir) == MODEL_TYPE:
        return load_post_ln_model(model_dir, device, dtype)
    return load_model(model_dir, device, dtype)

def write_random_post_ln(out_dir: Path, config: PostLNConfig, seed: int, tokenizer_dir: Path) -> Path:
    """A loadable Post-LN folder: seeded N(0, 0.02) weights (GPT-1's init), the tokenizer copied."""
    state = init_state(config, seed=seed, model_class=PostLNGPT, scale_residual=False)
    write_model_dir(out_dir, config, state)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copyfile(tokenizer_dir / name, out_dir / name)
    return out_dir

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("weights/post-ln-gpt2"))
    parser.add_argument("--preset", choices=list(PRESETS), default="post-ln-gpt2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-dir", type=Path, default=Path("weights/gpt2"))
    args = parser.parse_args(argv)
    write_random_post_ln(args.out, PostLNConfig.preset(args.preset), args.seed, args.tokenizer_dir)
    print(f"wrote a random-init {args.preset} (Post-LN) model to {args.out}")

if __name__ == "__main__":
    main()
