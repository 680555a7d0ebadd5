"""Engine test fixtures: our tiny model, transformers' reading of the same folder, helpers."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
from pathlib import Path

import pytest
import torch

import service.engine.layout as layout_module
from service.inprocess import Engine, EngineConfig
from service.engine.types import GenerationRequest, SamplingParams
from tests.conftest import TEST_DEVICE, TINY
from tests.model.hf_reference import load_reference
from weights.checkpoint import load_model
from weights.tokenizer import GPT2Tokenizer

_ids = itertools.count()
# GPT2_TEST_OVERLAP=1 (or 0) runs every engine these tests make with the core's overlap on (off);
# unset, the device decides (on for CUDA), as in the server.
OVERLAP = {"1": True, "0": False}.get(os.environ.get("GPT2_TEST_OVERLAP", ""))


# The core lays out and reads a step as a batch from BATCHED_ROWS running requests (row by row
# below, where that is cheaper): these tests' small batches take the batched path, which serves
# every large batch, unless GPT2_TEST_BATCHED_ROWS says otherwise ("16": the server's threshold,
# so the row-by-row paths run instead). test_batched_read.py compares the two.
BATCHED_ROWS = int(os.environ.get("GPT2_TEST_BATCHED_ROWS", "1"))


@pytest.fixture(autouse=True)
def batched_rows(monkeypatch):
    monkeypatch.setattr(layout_module, "BATCHED_ROWS", BATCHED_ROWS)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path, device: torch.device):
    return load_model(tiny_model_dir, device=device)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir: Path, device: torch.device):
    return load_reference(tiny_model_dir, TINY).to(device)


@pytest.fixture
def make_engine(tiny_model, tokenizer: GPT2Tokenizer):
    def make(tokenizer: GPT2Tokenizer = tokenizer, model=tiny_model, **config) -> Engine:
        return Engine(model, tokenizer, EngineConfig(**{"max_slots": 8, "overlap": OVERLAP, **config}))

    return make


def make_request(prompt_ids: list[int], request_id: str | None = None, **params) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id or f"req-{next(_ids)}",
        prompt_ids=list(prompt_ids),
        params=SamplingParams(**params),
        arrival_time=time.monotonic(),
    )


def random_prompt(length: int, seed: int, vocab: int = TINY.vocab_size) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


@torch.no_grad()
def hf_generate(hf_model, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """transformers' generate() on one prompt: the generated token ids only."""
    prompt = torch.tensor([prompt_ids], device=hf_model.device)  # [1, T]
    defaults = {"min_new_tokens": 0, "do_sample": False, "num_beams": 1, "pad_token_id": hf_model.config.eos_token_id}
    out = hf_model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens, **{**defaults, **kwargs}
    )
    return out[0, len(prompt_ids) :].tolist()


def drive(engine: Engine, steps: int) -> list:
    """Run `steps` engine steps; return every finished request they produced."""
    finished = []
    for _ in range(steps):
        finished.extend(engine.step().finished)
    return finished


def run_until_idle(engine: Engine, limit: int = 500) -> list:
    finished = []
    for _ in range(limit):
        if not engine.has_work():
            return finished
        finished.extend(engine.step().finished)
    raise AssertionError(f"engine still busy after {limit} steps")


# Outputs of one request run in different batches (alone, beside neighbours, overlapped, laid out
# row by row) are equal bit for bit on the CPU. On CUDA a row's logits change in their last bits
# with the batch around it (cuBLAS and the attention kernels pick their algorithm by shape; the
# contract in docs/batch-invariance.md): there tokens, texts and finish reasons must still be
# equal, and floats (log-probs, scores) within this tolerance.
CUDA_FLOAT_TOLERANCE = 1e-4


def assert_same_outputs(actual, expected, what: str = "") -> None:
    """`actual == expected` on the CPU; on CUDA the same, but floats within CUDA_FLOAT_TOLERANCE."""
    if TEST_DEVICE != "cuda":
        assert actual == expected, what
        return
    difference = first_difference(actual, expected, CUDA_FLOAT_TOLERANCE)
    assert difference is None, f"{what} {difference}".strip()


def first_difference(actual, expected, tolerance: float, where: str = "") -> str | None:
    """Where two nested outputs (dicts, lists, tuples, dataclasses, scalars) first differ, floats
    compared within `tolerance` (relative and absolute); None where they agree."""
    if isinstance(actual, float) and isinstance(expected, float):
        close = math.isclose(actual, expected, rel_tol=tolerance, abs_tol=tolerance)
        return None if close or (math.isnan(actual) and math.isnan(expected)) else f"at {where}: {actual!r} != {expected!r}"
    if dataclasses.is_dataclass(actual) and type(actual) is type(expected):
        actual, expected = ({f.name: getattr(x, f.name) for f in dataclasses.fields(x)} for x in (actual, expected))
    if isinstance(actual, dict) and isinstance(expected, dict):
        if actual.keys() != expected.keys():
            return f"at {where}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}"
        pairs = [(f"{where}[{key!r}]", actual[key], expected[key]) for key in actual]
    elif isinstance(actual, (list, tuple)) and type(actual) is type(expected):
        if len(actual) != len(expected):
            return f"at {where}: length {len(actual)} != {len(expected)}: {actual!r} != {expected!r}"
        pairs = [(f"{where}[{i}]", a, e) for i, (a, e) in enumerate(zip(actual, expected))]
    else:
        return None if actual == expected else f"at {where}: {actual!r} != {expected!r}"
    return next((d for path, a, e in pairs if (d := first_difference(a, e, tolerance, path)) is not None), None)
