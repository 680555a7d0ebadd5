"""Every bad checkpoint stops loading with one message naming the file and the tensor (issue 2).

Each case breaks a good tiny folder in one way and lists what the message must name. The same
message must reach the operator from `python -m service` (test_service_startup.py).
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY, write_tiny_model
from tests.weights.builders import edit_config, rewrite_tensors, shard
from weights.checkpoint import CONFIG_FILE, SHARD_INDEX, SINGLE_FILE, CheckpointError, load_model


@dataclass
class Breakage:
    """Breaks a model folder; returns the fragments the error message must contain."""

    name: str
    apply: Callable[[Path], list[str]]


def drop(name: str) -> Callable[[Path], list[str]]:
    def apply(model_dir: Path) -> list[str]:
        path = rewrite_tensors(model_dir, lambda t: t.pop(name))
        return [str(path), repr(name)]

    return apply


def replace(name: str, make: Callable[[torch.Tensor], torch.Tensor], *why: str):
    def apply(model_dir: Path) -> list[str]:
        path = rewrite_tensors(model_dir, lambda t: t.update({name: make(t[name])}))
        return [str(path), repr(name), *why]

    return apply


def add(name: str, *why: str):
    def apply(model_dir: Path) -> list[str]:
        path = rewrite_tensors(model_dir, lambda t: t.update({name: torch.zeros(3)}))
        return [str(path), repr(name), *why]

    return apply


def config_change(tensor: str, **changes):
    """A config.json that disagrees with the tensors: the message names both files."""

    def apply(model_dir: Path) -> list[str]:
        config = edit_config(model_dir, **changes)
        return [str(model_dir / SINGLE_FILE), repr(tensor), str(config)]

    return apply


def header_of(path: Path) -> tuple[int, dict]:
    """The safetensors header read directly: 8-byte little-endian length, then JSON."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    return size, json.loads(data[8:8 + size])


def truncate(model_dir: Path) -> list[str]:
    path = model_dir / SINGLE_FILE
    header_size, header = header_of(path)
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    last = max(tensors, key=lambda k: tensors[k]["data_offsets"][1])
    path.write_bytes(path.read_bytes()[:-100])  # as an interrupted download leaves it
    return [str(path), "truncated", repr(last)]


def corrupt_header(model_dir: Path) -> list[str]:
    path = model_dir / SINGLE_FILE
    data = bytearray(path.read_bytes())
    data[8:40] = b"{" + b"\x00" * 31  # the JSON header no longer parses
    path.write_bytes(bytes(data))
    return [str(path), "header"]


def differing_lm_head(model_dir: Path) -> list[str]:
    path = rewrite_tensors(
        model_dir, lambda t: t.update({"lm_head.weight": t["transformer.wte.weight"] * 1.5})
    )
    return [str(path), "'lm_head.weight'", "'transformer.wte.weight'"]


class RunsCode:
    """Unpickling this creates a file: proof that a loader unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def only_pickle(model_dir: Path) -> list[str]:
    (model_dir / SINGLE_FILE).unlink()
    (model_dir / "pytorch_model.bin").write_bytes(pickle.dumps(RunsCode(model_dir / "UNPICKLED")))
    return [str(model_dir), "pytorch_model.bin", "never loaded"]


def missing_shard(model_dir: Path) -> list[str]:
    shards = shard(model_dir, n_shards=2)
    (model_dir / shards[1]).unlink()
    return [str(model_dir / SHARD_INDEX), shards[1], "do not exist"]


def missing_config(model_dir: Path) -> list[str]:
    (model_dir / CONFIG_FILE).unlink()
    return [str(model_dir / CONFIG_FILE), "not found"]


def unreadable_config(model_dir: Path) -> list[str]:
    (model_dir / CONFIG_FILE).write_text('{"n_layer": 3,')
    return [str(model_dir / CONFIG_FILE)]


def unsupported_config(model_dir: Path) -> list[str]:
    config = edit_config(model_dir, add_cross_attention=True)
    return [str(config), "add_cross_attention"]


def unsupported_activation(model_dir: Path) -> list[str]:
    config = edit_config(model_dir, activation_function="prelu")  # a learned slope no checkpoint holds
    return [str(config), "activation_function 'prelu'"]


def transposed(weight: torch.Tensor) -> torch.Tensor:
    return weight.t().contiguous()  # [out, in] where GPT-2 stores [in, out]


def with_a_nan(bias: torch.Tensor) -> torch.Tensor:
    return bias.index_fill(0, torch.tensor([5]), float("nan"))


BREAKAGES = [
    Breakage("missing-tensor", drop("transformer.h.1.mlp.c_fc.bias")),
    Breakage("unexpected-tensor", add("transformer.h.0.attn.q_proj.weight", "unexpected")),
    Breakage(
        "mis-shaped-tensor",
        replace("transformer.h.2.mlp.c_fc.weight", transposed, "[256, 64]", "[64, 256]"),
    ),
    Breakage("config-more-layers", config_change("transformer.h.3.attn.c_attn.bias", n_layer=4)),
    Breakage("config-fewer-layers", config_change("transformer.h.2.attn.c_attn.bias", n_layer=2)),
    Breakage("config-narrower", config_change("transformer.h.0.attn.c_attn.bias", n_embd=32)),
    Breakage("truncated-file", truncate),
    Breakage("corrupt-header", corrupt_header),
    Breakage("nan-values", replace("transformer.h.0.ln_2.bias", with_a_nan, "NaN")),
    Breakage(
        "integer-dtype", replace("transformer.wpe.weight", lambda w: w.to(torch.int32), "torch.int32")
    ),
    Breakage("lm-head-differs-from-wte", differing_lm_head),
    Breakage("only-pickled-checkpoint", only_pickle),
    Breakage("shard-index-names-missing-shard", missing_shard),
    Breakage("missing-config", missing_config),
    Breakage("unreadable-config", unreadable_config),
    Breakage("unsupported-config-option", unsupported_config),
    Breakage("unsupported-activation", unsupported_activation),
]


def broken_model(tmp_path: Path, breakage: Breakage) -> tuple[Path, list[str]]:
    model_dir = write_tiny_model(tmp_path / breakage.name)
    return model_dir, breakage.apply(model_dir)


def load_error(model_dir: Path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as caught:
        load_model(model_dir, **kwargs)
    message = str(caught.value)
    assert "\n" not in message  # one message, one line in a log
    return message


@pytest.mark.parametrize("breakage", BREAKAGES, ids=[b.name for b in BREAKAGES])
def test_bad_checkpoint_message_names_file_and_tensor(tmp_path, breakage):
    model_dir, fragments = broken_model(tmp_path, breakage)
    message = load_error(model_dir)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"


@pytest.mark.parametrize("breakage", BREAKAGES, ids=[b.name for b in BREAKAGES])
def test_service_main_exits_with_the_message(tmp_path, monkeypatch, breakage):
    import service.__main__ as entry
    import service.http.server

    def serve(*args, **kwargs):
        raise AssertionError("the service started on a bad checkpoint")

    monkeypatch.setattr(service.http.server, "serve", serve)  # a regression must fail, not hang here
    model_dir, _ = broken_model(tmp_path, breakage)
    message = load_error(model_dir)
    with pytest.raises(SystemExit) as caught:
        entry.main(["--model-dir", str(model_dir)])
    assert isinstance(caught.value.code, str) and message in caught.value.code


def test_pickled_checkpoint_is_never_unpickled(tmp_path):
    model_dir, _ = broken_model(tmp_path, Breakage("only-pickled-checkpoint", only_pickle))
    load_error(model_dir)
    assert not (model_dir / "UNPICKLED").exists()
    # The bait works: unpickling it does create the marker.
    pickle.loads((model_dir / "pytorch_model.bin").read_bytes())
    assert (model_dir / "UNPICKLED").exists()


def test_infinite_values_are_refused(tmp_path):
    model_dir = write_tiny_model(tmp_path)
    path = rewrite_tensors(model_dir, lambda t: t["transformer.ln_f.weight"].fill_(float("inf")))
    message = load_error(model_dir)
    assert str(path) in message and "'transformer.ln_f.weight'" in message


def test_values_beyond_float16_are_refused_when_serving_float16(tmp_path):
    model_dir = write_tiny_model(tmp_path)
    name = "transformer.h.0.mlp.c_proj.weight"
    rewrite_tensors(model_dir, lambda t: t[name].index_fill_(0, torch.tensor([0]), 1e5))
    load_model(model_dir, dtype=torch.float32)  # fine in float32
    message = load_error(model_dir, dtype=torch.float16)
    assert repr(name) in message and "float16" in message


def test_bare_names_are_named_bare_in_messages(tmp_path):
    model_dir = write_tiny_model(tmp_path, prefixed=False)
    drop("h.0.ln_1.weight")(model_dir)
    message = load_error(model_dir)
    assert "'h.0.ln_1.weight'" in message and "transformer." not in message


def test_shard_index_may_not_point_outside_the_folder(tmp_path):
    model_dir = write_tiny_model(tmp_path / "model")
    shard(model_dir, n_shards=2)
    index = json.loads((model_dir / SHARD_INDEX).read_text())
    index["weight_map"]["transformer.wte.weight"] = "../elsewhere.safetensors"
    (model_dir / SHARD_INDEX).write_text(json.dumps(index))
    assert "../elsewhere.safetensors" in load_error(model_dir)


def test_good_folder_loads(tmp_path):
    # The breakages start from this folder: it must load, or every case above passes for nothing.
    model = load_model(write_tiny_model(tmp_path))
    assert model.config == TINY
