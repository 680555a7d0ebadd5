"""Fixtures shared by every test package: checkpoints the tests write, and the default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from model.config import GPT2Config
from weights.random_init import init_state, write_model_dir
from weights.tokenizer import GPT2Tokenizer

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO / "weights" / "gpt2"

# Small enough for fast tests, shaped like GPT-2 in every way that matters (several heads,
# several layers, the real vocabulary so the real tokenizer works with it).
TINY = GPT2Config(vocab_size=50257, n_positions=128, n_embd=64, n_layer=3, n_head=4)


def perturbed_state(config: GPT2Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """GPT-2's initialisation, then random biases and LayerNorm parameters.

    GPT-2's init leaves every bias 0 and every LayerNorm gain 1: a checkpoint like that cannot
    show a bug that mixes up or drops a bias. These tensors can.
    """
    state = init_state(config, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, tensor in state.items():
        if name.endswith("bias"):
            tensor.normal_(0.0, 0.02, generator=generator)
        elif ".ln_" in f".{name}":
            tensor.normal_(1.0, 0.1, generator=generator)
    return state


def write_tiny_model(
    out_dir: Path, config: GPT2Config = TINY, seed: int = 0, prefixed: bool = True, **kwargs
) -> Path:
    """A loadable model folder (config, weights, GPT-2 tokenizer) for a small config."""
    write_model_dir(out_dir, config, perturbed_state(config, seed), prefixed=prefixed, **kwargs)
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        (out_dir / name).write_bytes((DEFAULT_MODEL_DIR / name).read_bytes())
    return out_dir


# The CUDA lane: GPT2_TEST_DEVICE=cuda (make test-cuda) runs the device-aware suites on the GPU,
# against transformers on the same GPU.
TEST_DEVICE = os.environ.get("GPT2_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def device() -> torch.device:
    if TEST_DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("GPT2_TEST_DEVICE=cuda, but torch sees no CUDA device")
    return torch.device(TEST_DEVICE)


def error_of(response) -> tuple[str, str]:
    """(kind, message) of an error answer: TGI's shape, or OpenAI's under /v1 (the kind its code)."""
    body = response.json()
    if isinstance(body["error"], dict):
        return body["error"]["code"], body["error"]["message"]
    return body["error_type"], body["error"]


def assert_validation_error(response, *words: str) -> None:
    """The service's 422: kind "validation" and a message naming what is wrong."""
    assert response.status_code == 422, response.text
    kind, message = error_of(response)
    assert kind == "validation", response.json()
    for word in words:
        assert word in message, (word, message)


@pytest.fixture(autouse=True, scope="session")
def single_thread():
    """Tests run tiny tensors: one intra-op thread avoids the hand-off cost that dominates them
    on a shared 2-core machine (measured: 40 ms vs 1 ms for a tiny LM head on a busy box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    if not (DEFAULT_MODEL_DIR / "model.safetensors").exists():
        pytest.fail(f"{DEFAULT_MODEL_DIR} is not prepared: run `make weights` (make test does)")
    return DEFAULT_MODEL_DIR


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> GPT2Tokenizer:
    return GPT2Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantize_mode(request: pytest.FixtureRequest) -> str:
    """Each quantized mode, where this machine can serve it on the CPU in float32 (else skipped, saying why)."""
    from model.quantized import quantize_problem

    problem = quantize_problem(request.param, "cpu", torch.float32)
    if problem is not None:
        pytest.skip(problem)
    return request.param
