"""Load GPT-2 safetensors checkpoints strictly: every problem stops start-up naming the tensor."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from model.config import GPT2Config
from model.gpt2 import GPT2
from weights.names import TIED, canonical_name, is_ignored

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the file and the tensor."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model folder: one file, or the shards its index lists."""
    index = model_dir / SHARD_INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid shard index ({exc})") from exc
        shards = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(p) for p in shards if not p.exists()]
        if missing:
            raise CheckpointError(f"{index}: lists shard files that do not exist: {missing}")
        return shards
    single = model_dir / SINGLE_FILE
    if single.exists():
        return [single]
    pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
        p.name for p in model_dir.glob("*.pt*")
    )
    hint = (
        f" Found {pickles}: pickled checkpoints are never loaded (unpickling runs code);"
        " convert them to safetensors first."
        if pickles
        else ""
    )
    raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {SHARD_INDEX}.{hint}")


def _read_tensors(files: list[Path]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    yield path, name, reader.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc


def read_state_dict(model_dir: Path, config: GPT2Config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors renamed to our module names, checked against the config, converted to dtype."""
    expected = _expected_shapes(config)
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    tied: dict[str, tuple[Path, torch.Tensor]] = {}
    for path, raw_name, tensor in _read_tensors(checkpoint_files(model_dir)):
        name = canonical_name(raw_name)
        if is_ignored(name):
            continue
        where = f"{path}: tensor {raw_name!r}"
        if name in TIED:
            tied[name] = (path, tensor)
            continue
        if name not in expected:
            raise CheckpointError(f"{where} is unexpected for {_describe(config)}")
        if name in state:
            raise CheckpointError(f"{where} duplicates one already read from {origin[name]}")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"{where} has shape {list(tensor.shape)}, but {_describe(config)} needs"
                f" {list(expected[name])}"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(f"{where} has dtype {tensor.dtype}; expected a float dtype")
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{where} contains NaN or infinite values")
        state[name] = tensor.to(dtype)
        origin[name] = path

    missing = sorted(set(expected) - set(state), key=_natural_key)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(
            f"{model_dir}: missing {len(missing)} tensor(s) needed by {_describe(config)}: {shown}"
        )
    for name, (path, tensor) in tied.items():
        target = state[TIED[name]]
        if tuple(tensor.shape) != tuple(target.shape) or not torch.equal(tensor.to(dtype), target):
            raise CheckpointError(
                f"{path}: tensor {name!r} differs from {TIED[name]!r}; GPT-2 ties them and an"
                " untied head is not supported"
            )
    return state


def load_model(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> GPT2:
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    state = read_state_dict(model_dir, config, dtype)
    with torch.device("meta"):
        model = GPT2(config)
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(device=device).eval().requires_grad_(False)
    model.prepare_lm_head()
    return model


def load_config(model_dir: Path) -> GPT2Config:
    path = model_dir / CONFIG_FILE
    if not path.exists():
        raise CheckpointError(f"{model_dir}: no {CONFIG_FILE}")
    try:
        return GPT2Config.from_json(path)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(str(exc)) from exc


def _expected_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in GPT2(config).named_parameters()}


def _describe(config: GPT2Config) -> str:
    return (
        f"the config (n_layer={config.n_layer}, n_embd={config.n_embd}, n_head={config.n_head},"
        f" vocab_size={config.vocab_size}, n_positions={config.n_positions})"
    )


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in name.split(".")]
