"""Fixtures for the analysis tests: the tiny model (ours and transformers'), an app serving it."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.settings import Settings
from tests.analysis.document_recipe import load_document_model, load_document_tokenizer
from weights.checkpoint import load_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention is not all you need: pure attention loses rank doubly exponentially with depth.",
    "Hi",
    "Pre-LN moves the layer norm in front of each sub-block, so the scale of queries and keys is reset in every layer.",
]
ANALYSIS_MAX_TOKENS = 40


@pytest.fixture(scope="package")
def tiny_model(tiny_model_dir: Path):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="package")
def tiny_document_model(tiny_model_dir: Path):
    return load_document_model(tiny_model_dir)


@pytest.fixture(scope="package")
def document_tokenizer(tiny_model_dir: Path):
    return load_document_tokenizer(tiny_model_dir)


@pytest.fixture(scope="package")
def app(tiny_model_dir: Path):
    # One torch thread: the tests share two cores with other work and the tiny model gains nothing.
    settings = Settings(
        model_dir=tiny_model_dir, model_name="tiny", threads=1, max_batch_size=2,
        analysis_max_texts=4, analysis_max_tokens=ANALYSIS_MAX_TOKENS, analysis_max_concurrent=1,
    )
    return create_app(settings)


@pytest.fixture(scope="package")
def client(app):
    with TestClient(app) as test_client:
        yield test_client
