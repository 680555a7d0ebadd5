"""The playground tests' fixtures: one live server (a small model with a long context, so a
generation lasts long enough to be stopped, and a second model for the comparison curve) and one
headless Chromium, shared by the module's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY, write_tiny_model
from tests.playground.browser import MISSING, chromium
from tests.service.conftest import LONG_CONTEXT
from tests.service.live import live_server


@pytest.fixture(scope="package")
def playground_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("playground-model"), LONG_CONTEXT)


@pytest.fixture(scope="package")
def compare_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("compare-model"), TINY, seed=1)


@pytest.fixture(scope="module")
def browser():
    if MISSING:
        pytest.skip(MISSING)
    with chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def server(playground_model_dir: Path, compare_model_dir: Path):
    with live_server(
        playground_model_dir, compare_model_dir=compare_model_dir, max_batch_size=4, max_new_tokens=1000
    ) as running:
        yield running
