"""Fixtures for the analysis tests: the tiny model (ours and transformers'), a tiny Post-LN GPT-1
(ours and transformers'), an app serving the first, and one that also loads the second.

Models and tensors live on the `device` fixture (GPT2_TEST_DEVICE, default cpu)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.settings import Settings
from tests.analysis.document_recipe import load_document_model, load_document_tokenizer
from tests.analysis.post_ln_reference import load_post_ln_reference, write_post_ln_checkpoint
from weights.checkpoint import load_model
from weights.post_ln import load_post_ln_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention is not all you need: pure attention loses rank doubly exponentially with depth.",
    "Hi",
    "Pre-LN moves the layer norm in front of each sub-block, so the scale of queries and keys is reset in every layer.",
]
ANALYSIS_MAX_TOKENS = 40


@pytest.fixture(scope="package")
def tiny_model(tiny_model_dir: Path, device):
    return load_model(tiny_model_dir, device=device)


@pytest.fixture(scope="package")
def tiny_document_model(tiny_model_dir: Path, device):
    return load_document_model(tiny_model_dir).to(device)


@pytest.fixture(scope="package")
def tiny_post_ln_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return write_post_ln_checkpoint(tmp_path_factory.mktemp("tiny-post-ln"), default_model_dir)


@pytest.fixture(scope="package")
def tiny_post_ln_model(tiny_post_ln_dir: Path, device):
    return load_post_ln_model(tiny_post_ln_dir, device=device)


@pytest.fixture(scope="package")
def tiny_post_ln_reference(tiny_post_ln_dir: Path, device):
    return load_post_ln_reference(tiny_post_ln_dir).to(device)


@pytest.fixture(scope="package")
def document_tokenizer(tiny_model_dir: Path):
    return load_document_tokenizer(tiny_model_dir)


@pytest.fixture(scope="package")
def app(tiny_model_dir: Path, device):
    # One torch thread: the tests share two cores with other work and the tiny model gains nothing.
    settings = Settings(
        model_dir=tiny_model_dir, model_name="tiny", threads=1, max_batch_size=2, device=device.type,
        analysis_max_texts=4, analysis_max_tokens=ANALYSIS_MAX_TOKENS, analysis_max_concurrent=1,
    )
    return create_app(settings)


@pytest.fixture(scope="package")
def client(app):
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture(scope="package")
def compare_client(tiny_model_dir: Path, tiny_post_ln_dir: Path, device):
    """Default analysis limits (the model's context), and the Post-LN model to compare with."""
    settings = Settings(
        model_dir=tiny_model_dir, model_name="tiny", threads=1, max_batch_size=2, device=device.type,
        compare_model_dir=tiny_post_ln_dir, compare_model_name="tiny-post-ln",
    )
    with TestClient(create_app(settings)) as test_client:
        yield test_client
