"""Edits to a model folder the tests write: shard it, rewrite its tensors, change its config."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from weights.checkpoint import CONFIG_FILE, SHARD_INDEX, SINGLE_FILE

Tensors = dict[str, torch.Tensor]


def shard(model_dir: Path, n_shards: int = 2) -> list[str]:
    """Split model.safetensors into shards plus an index, as transformers' save_pretrained does."""
    tensors = load_file(str(model_dir / SINGLE_FILE))
    names = sorted(tensors)
    shard_names = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    weight_map = {}
    for i, shard_name in enumerate(shard_names):
        part = names[i::n_shards]
        save_file({n: tensors[n] for n in part}, str(model_dir / shard_name), metadata={"format": "pt"})
        weight_map.update({n: shard_name for n in part})
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (model_dir / SHARD_INDEX).write_text(json.dumps(index, indent=2))
    (model_dir / SINGLE_FILE).unlink()
    return shard_names


def rewrite_tensors(model_dir: Path, edit: Callable[[Tensors], object]) -> Path:
    """Let `edit` change the dict of model.safetensors' tensors in place, then save it."""
    path = model_dir / SINGLE_FILE
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def edit_config(model_dir: Path, **changes) -> Path:
    path = model_dir / CONFIG_FILE
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config, indent=2))
    return path
