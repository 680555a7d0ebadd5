"""HTTP-layer fixtures: in-process apps on the tiny model, a transformers reference, and the
SSE parsing every streaming test needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from service.app import create_app
from service.settings import Settings
from tests.conftest import TINY, write_tiny_model
from tests.model.hf_reference import load_reference

# Log-probabilities of two implementations of the same fp32 arithmetic.
LOGPROB_TOLERANCE = 1e-4
# A small model with a long context: generations that last seconds, long enough for a test to act
# while they run (TINY's 128-token context ends them in milliseconds, and at 64 wide a 900-token
# answer takes under two seconds, less than a busy server's HTTP side may lag behind its engine).
LONG_CONTEXT = TINY.with_(n_positions=1024, n_embd=256, n_layer=4)


def settings_for(model_dir: Path, **overrides) -> Settings:
    # One torch thread: the tests share two cores with other work and the tiny model gains
    # nothing from more.
    base = dict(model_dir=model_dir, threads=1, max_batch_size=4, max_waiting=16)
    return Settings(**{**base, **overrides})


@pytest.fixture(scope="package")
def client(tiny_model_dir: Path):
    with TestClient(create_app(settings_for(tiny_model_dir))) as test_client:
        yield test_client


@pytest.fixture(scope="package")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-long"), LONG_CONTEXT)


@pytest.fixture(scope="package")
def reference(tiny_model_dir: Path):
    return load_reference(tiny_model_dir, TINY)


@torch.no_grad()
def greedy_reference(reference, prompt_ids: list[int], max_new_tokens: int, eos: int | None) -> tuple[list[int], list[float]]:
    """Greedy decoding by direct computation on transformers' model: ids and their log-probs."""
    ids, logprobs = list(prompt_ids), []
    for _ in range(max_new_tokens):
        logits = reference(torch.tensor([ids])).logits[0, -1]  # [V]
        token = int(logits.argmax())
        ids.append(token)
        logprobs.append(float(logits.log_softmax(-1)[token]))
        if token == eos:
            break
    return ids[len(prompt_ids):], logprobs


@torch.no_grad()
def prompt_logprobs_reference(reference, prompt_ids: list[int]) -> list[float]:
    """log p(token i | tokens before it) for i >= 1."""
    logprobs = reference(torch.tensor([prompt_ids])).logits[0].log_softmax(-1)  # [T, V]
    return [float(logprobs[i - 1, t]) for i, t in enumerate(prompt_ids) if i > 0]


def sse_payloads(lines) -> list:
    """The JSON payloads of a text/event-stream body (lines without their newlines)."""
    payloads = []
    for line in lines:
        if line.startswith("data:"):
            data = line[len("data:"):].strip()
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads
