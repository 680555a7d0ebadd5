"""Prepare a model folder: real GPT-2 from the Hugging Face hub when online, else the offline
default (GPT-2's real tokenizer and a deterministic random-init GPT-2 124M).

    python -m weights.prepare [--out weights/gpt2] [--source auto|hub|random] [--force]
                              [--seed 0] [--preset gpt2|gpt2-medium|gpt2-large|gpt2-xl|distilgpt2]

`auto` tries the hub only when not offline (HF_HUB_OFFLINE=1 or GPT2_OFFLINE=1 switch it off) and
the hub answers within a few seconds; otherwise it builds the offline default. `--preset` picks
the random-init model's size (the hub source is always openai-community/gpt2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from model.config import PRESETS, GPT2Config
from weights.bpe_source import write_tokenizer_files
from weights.checkpoint import CONFIG_FILE, SINGLE_FILE, load_model
from weights.random_init import init_state, write_model_dir

ORIGIN_FILE = "ORIGIN.json"
DEFAULT_DIR = Path(__file__).resolve().parent / "gpt2"
CACHE_DIR = Path(__file__).resolve().parent / ".cache"
HUB_REPO = "openai-community/gpt2"
HUB_FILES = ["config.json", "model.safetensors", "tokenizer.json", "vocab.json", "merges.txt"]
HUB_HOST = "huggingface.co"
DEFAULT_SEED = 0


def is_offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "GPT2_OFFLINE"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """A TCP connect with a short timeout: here every host but the package registries hangs."""
    try:
        with socket.create_connection((HUB_HOST, 443), timeout=timeout):
            return True
    except OSError:
        return False


def read_origin(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / ORIGIN_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {"source": "user", "path": str(model_dir)}


def is_prepared(model_dir: Path) -> bool:
    return all((model_dir / name).exists() for name in (ORIGIN_FILE, CONFIG_FILE, SINGLE_FILE, "tokenizer.json"))


def prepare_from_hub(out_dir: Path, repo: str) -> dict:
    # Bounded waits: a hub that does not answer must not hang set-up.
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "30")
    from huggingface_hub import hf_hub_download

    for name in HUB_FILES:
        shutil.copy(hf_hub_download(repo, name), out_dir / name)
    return {"source": "huggingface-hub", "repo": repo}


def prepare_random(out_dir: Path, seed: int, config: GPT2Config) -> dict:
    write_model_dir(out_dir, config, init_state(config, seed=seed, progress=True), prefixed=True)
    write_tokenizer_files(out_dir, CACHE_DIR)
    return {
        "source": "random-init",
        "seed": seed,
        "init": "GPT-2 initialisation: N(0, 0.02), residual projections / sqrt(2 n_layer)",
        "tokenizer": "GPT-2 BPE rebuilt from openai-whisper==20250625 gpt2.tiktoken, sha256-checked",
    }


def prepare(
    out_dir: Path,
    source: str = "auto",
    seed: int = DEFAULT_SEED,
    force: bool = False,
    config: GPT2Config = PRESETS["gpt2"],
) -> dict:
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / ORIGIN_FILE).exists():
        # Someone's own model folder: replacing it would destroy their checkpoint.
        raise FileExistsError(f"{out_dir} holds files weights.prepare did not write; not replacing them")
    if is_prepared(out_dir) and not force:
        return read_origin(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        origin = _build(tmp, source, seed, config)
        load_model(tmp)  # refuse to publish a folder the server could not load
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return origin


def _build(tmp: Path, source: str, seed: int, config: GPT2Config) -> dict:
    use_hub = source == "hub" or (source == "auto" and not is_offline() and hub_reachable())
    origin: dict | None = None
    if use_hub:
        try:
            origin = prepare_from_hub(tmp, HUB_REPO)
        except Exception as exc:  # any hub failure falls back to the offline default
            if source == "hub":
                raise
            print(f"hub download failed ({exc}); building the offline default", file=sys.stderr)
    if origin is None:
        origin = prepare_random(tmp, seed, config)
    origin["prepared_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (tmp / ORIGIN_FILE).write_text(json.dumps(origin, indent=2) + "\n")
    return origin


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--source", choices=("auto", "hub", "random"), default="auto")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--preset", choices=list(PRESETS), default="gpt2", help="random-init size")
    args = parser.parse_args(argv)
    try:
        origin = prepare(args.out, args.source, args.seed, args.force, PRESETS[args.preset])
    except FileExistsError as exc:
        sys.exit(str(exc))
    print(f"{args.out}: {json.dumps(origin)}")


if __name__ == "__main__":
    main()
