"""The real application on a tiny model: the routes and the /metrics the deployment files rely on.

It runs with an API key, as a production deployment may: health checks, probes and Prometheus
carry no credentials, so what they reach must answer without them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.settings import Settings
from tests.deploy.deploy_files import exported_series

API_KEY = "deploy-test-key"


@pytest.fixture(scope="session")
def served_app(tiny_model_dir: Path):
    app = create_app(Settings(model_dir=tiny_model_dir, max_batch_size=2, api_key=API_KEY))
    with TestClient(app) as client:
        yield app, client


@pytest.fixture(scope="session")
def get_status(served_app):
    """The status a GET without credentials answers: what a probe or a scrape would see."""
    _, client = served_app
    # Guards the fixture: were the key not enforced, every path would look open.
    assert client.get("/info").status_code == 401
    return lambda path: client.get(path).status_code


@pytest.fixture(scope="session")
def scraped_series(served_app) -> dict[str, set[str]]:
    """Series names (with their label names) of a scrape taken after one generation.

    The generation makes the labelled series (per endpoint and outcome) exist, as they would
    on a serving replica.
    """
    _, client = served_app
    generated = client.post(
        "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert generated.status_code == 200, generated.text
    scrape = client.get("/metrics")
    assert scrape.status_code == 200, "the service exports no /metrics"
    return exported_series(scrape.text)
