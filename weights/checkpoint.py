"""Load GPT-2 safetensors checkpoints strictly: every problem stops start-up naming the tensor."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

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
        names = set(weight_map.values())
        outside = sorted(n for n in names if not isinstance(n, str) or Path(n).name != n)
        if outside:
            raise CheckpointError(f"{index}: shard names must be file names in {model_dir}: {outside}")
        missing = sorted(n for n in names if not (model_dir / n).exists())
        if missing:
            raise CheckpointError(f"{index}: lists shard files that do not exist: {missing}")
        return sorted(model_dir / n for n in names)
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


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        cut = _cut_off_tensor(path)
        if cut:
            raise CheckpointError(f"{path}: truncated file: {cut}") from exc
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc


def _read_tensors(files: list[Path]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    for path in files:
        with _open(path) as reader:
            for name in reader.keys():
                try:
                    tensor = reader.get_tensor(name)
                except (SafetensorError, RuntimeError, TypeError) as exc:
                    raise CheckpointError(f"{path}: tensor {name!r} cannot be read ({exc})") from exc
                yield path, name, tensor


def _cut_off_tensor(path: Path) -> str | None:
    """Which tensor's bytes a cut-short file lacks, read from its (intact) header; else None.

    safetensors only says "file not fully covered"; naming the tensor tells a partial download
    from a file that was never a checkpoint.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            header_size = int.from_bytes(f.read(8), "little")
            if header_size > size - 8:
                return None  # the header itself is cut or corrupt: no tensor to name
            header = json.loads(f.read(header_size))
        ends = {
            name: 8 + header_size + int(info["data_offsets"][1])
            for name, info in header.items()
            if name != "__metadata__"
        }
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    cut = [(end, name) for name, end in ends.items() if end > size]
    if not cut:
        return None
    end, name = min(cut)
    return (
        f"tensor {name!r} needs bytes up to {end} but the file has {size}"
        f" ({len(cut)} of {len(ends)} tensors cut off)"
    )


def read_state_dict(
    model_dir: Path, config: GPT2Config, dtype: torch.dtype, model_class: type[nn.Module] = GPT2, tied: dict[str, str] = TIED
) -> dict[str, torch.Tensor]:
    """Tensors renamed to our module names, checked against the config, converted to dtype.

    `model_class(config)` gives the parameters expected; `tied` maps a tensor that must equal
    another one (an LM head tied to the embeddings) to that one.
    """
    return _checked_tensors(model_dir, config, dtype, model_class, tied, keep=None)


def check_checkpoint(
    model_dir: Path, config, model_class: type[nn.Module] = GPT2, tied: dict[str, str] = TIED,
    dtype: torch.dtype = torch.float32,
) -> None:
    """read_state_dict's checks, keeping no tensor but the tied heads' targets: for a server to
    run before spawning the processes that load the weights, so a bad checkpoint stops it in
    one line first. One tensor at a time, on the CPU."""
    _checked_tensors(model_dir, config, dtype, model_class, tied, keep=set(tied.values()))


def checkpoint_parameters(model_dir: Path, tied: dict[str, str] = TIED) -> int:
    """The model's parameter count, from the files' headers alone (a tied head counted once)."""
    count = 0
    for path in checkpoint_files(model_dir):
        with _open(path) as reader:
            for raw_name in reader.keys():
                name = canonical_name(raw_name)
                if not is_ignored(name) and name not in tied:
                    count += math.prod(reader.get_slice(raw_name).get_shape())
    return count


def _checked_tensors(
    model_dir: Path, config, dtype: torch.dtype, model_class: type[nn.Module], tied: dict[str, str], keep: set[str] | None
) -> dict[str, torch.Tensor]:
    """The checked tensors named in `keep` (None: all)."""
    files = checkpoint_files(model_dir)
    expected = _expected_shapes(config, model_class)
    described = _describe(model_dir, config)
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    tied_copies: dict[str, tuple[str, torch.Tensor]] = {}
    prefix = ""  # the checkpoint's naming, so messages use the names its author will recognise
    for path, raw_name, tensor in _read_tensors(files):
        name = canonical_name(raw_name)
        if is_ignored(name):
            continue
        where = f"{path}: tensor {raw_name!r}"
        if name in tied:
            tied_copies[name] = (where, tensor)
            continue
        prefix = raw_name[: len(raw_name) - len(name)]
        if name not in expected:
            raise CheckpointError(f"{where} is unexpected: {described} has no such parameter")
        if name in origin:
            raise CheckpointError(f"{where} duplicates one already read from {origin[name]}")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"{where} has shape {list(tensor.shape)}, but {described} needs {list(expected[name])}"
            )
        converted = _converted(where, tensor, dtype)
        if keep is None or name in keep:
            state[name] = converted
        origin[name] = path

    missing = sorted(set(expected) - set(origin), key=_natural_key)
    if missing:
        shown = ", ".join(repr(prefix + n) for n in missing[:5]) + (" ..." if len(missing) > 5 else "")
        source = files[0] if len(files) == 1 else f"{model_dir} ({len(files)} shards)"
        raise CheckpointError(f"{source}: lacks {len(missing)} tensor(s) that {described} needs: {shown}")
    for name, (where, tensor) in tied_copies.items():
        target = state[tied[name]]
        if tuple(tensor.shape) != tuple(target.shape) or not torch.equal(tensor.to(dtype), target):
            raise CheckpointError(
                f"{where} differs from {prefix + tied[name]!r}; the model ties them and an untied"
                " head is not supported"
            )
    return state


def _converted(where: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise CheckpointError(f"{where} has dtype {tensor.dtype}; expected a float dtype")
    if not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(f"{where} contains NaN or infinite values")
    converted = tensor.to(dtype)
    if not bool(torch.isfinite(converted).all()):
        # float32 values beyond float16's range become inf: serving them would give NaN logits.
        raise CheckpointError(
            f"{where} has values up to {tensor.abs().max().item():.3g}, beyond the range of {dtype}"
        )
    return converted


def load_model(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> GPT2:
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    return build_model(GPT2, config, read_state_dict(model_dir, config, dtype), device)


def build_model(model_class: type[nn.Module], config, state: dict[str, torch.Tensor], device: str | torch.device):
    """The model with these tensors, on `device`, ready for inference (laid out by `prepare`)."""
    with torch.device("meta"):
        model = model_class(config)
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(device=device).eval().requires_grad_(False)
    model.prepare()
    return model


def load_config(model_dir: Path) -> GPT2Config:
    path = model_dir / CONFIG_FILE
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    if not path.exists():
        raise CheckpointError(f"{path}: not found; a model folder needs a Hugging Face {CONFIG_FILE}")
    try:
        return GPT2Config.from_json(path)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(str(exc)) from exc
    except RecursionError:
        # json nests one Python call per level: a hostile file 10^5 levels deep exhausts the stack.
        raise CheckpointError(f"{path}: nested too deeply to be a config") from None


def _expected_shapes(config: GPT2Config, model_class: type[nn.Module] = GPT2) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in model_class(config).named_parameters()}


def _describe(model_dir: Path, config: GPT2Config) -> str:
    return (
        f"the model {model_dir / CONFIG_FILE} describes (n_layer={config.n_layer},"
        f" n_embd={config.n_embd}, n_head={config.n_head}, n_inner={config.inner_dim},"
        f" vocab_size={config.vocab_size}, n_positions={config.n_positions})"
    )


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in name.split(".")]
