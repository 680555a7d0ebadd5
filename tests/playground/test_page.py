"""The page as the server sends it (in-process, no browser): what a first load fetches and its
size, the headers that keep it to its own files, and the settings and auth around it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.launch import parse_settings
from service.app import create_app
from service.http.routes_playground import ASSETS
from tests.service.conftest import settings_for

FIRST_LOAD_LIMIT = 200_000  # bytes (issue 19)


def first_load(client: TestClient) -> dict[str, bytes]:
    """Everything a browser fetches to show the page: the HTML, what it links, and the ES
    modules' imports, followed to the end."""
    page = client.get("/")
    assert page.status_code == 200
    loaded = {"/": page.content}
    pending = re.findall(r'(?:src|href)="(/playground/[^"]+)"', page.text)
    while pending:
        path = pending.pop()
        if path in loaded:
            continue
        response = client.get(path)
        assert response.status_code == 200, (path, response.text)
        loaded[path] = response.content
        if path.endswith(".js"):
            pending += ["/playground/" + name for name in re.findall(r'from "\./([^"]+)"', response.text)]
    return loaded


@pytest.fixture(scope="module")
def app_client(tiny_model_dir: Path):
    # No `with`: the engine core is not started; nothing here generates.
    return TestClient(create_app(settings_for(tiny_model_dir)))


def test_first_load_is_every_asset_and_at_most_200_kB(app_client: TestClient) -> None:
    loaded = first_load(app_client)
    assert {path.removeprefix("/playground/") for path in loaded if path != "/"} == set(ASSETS) - {"index.html"}
    # What the page asks the API for before it is ready counts too.
    for path in ("/info", "/openapi.json"):
        loaded[path] = app_client.get(path).content
    assert sum(len(body) for body in loaded.values()) <= FIRST_LOAD_LIMIT


def test_page_is_html_limited_to_its_own_origin(app_client: TestClient) -> None:
    page = app_client.get("/")
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script type="module" src="/playground/app.js">' in page.text
    script = app_client.get("/playground/app.js")
    assert script.headers["content-type"].startswith("text/javascript")
    # No third-party origin anywhere: the page must work offline.
    for body in first_load(app_client).values():
        assert not re.search(rb"https?://(?!www\.w3\.org/2000/svg)", body)


def test_unknown_asset_is_404(app_client: TestClient) -> None:
    response = app_client.get("/playground/secrets.py")
    assert response.status_code == 404
    assert response.json()["error_type"] == "not_found"


def test_page_is_outside_the_api_schema_and_the_metrics(app_client: TestClient) -> None:
    app_client.get("/")
    app_client.get("/playground/app.css")
    assert "get" not in app_client.get("/openapi.json").json()["paths"]["/"]
    metrics = app_client.get("/metrics").text
    assert 'gpt2_requests_total{endpoint="/",outcome="success"} 0.0' in metrics
    assert "/playground" not in metrics


def test_no_playground_flag_makes_get_root_404(tiny_model_dir: Path) -> None:
    settings = parse_settings(["--model-dir", str(tiny_model_dir), "--threads", "1", "--no-playground"])
    assert settings.playground is False
    client = TestClient(create_app(settings))
    response = client.get("/")
    assert response.status_code == 404
    assert "--no-playground" in response.json()["error"]
    assert client.get("/playground/app.js").status_code == 404
    # TGI's POST / is still served: a body without inputs is its 422, not a missing route.
    assert client.post("/", json={}).status_code == 422


def test_playground_is_on_by_default(tiny_model_dir: Path) -> None:
    assert parse_settings(["--model-dir", str(tiny_model_dir)]).playground is True


def test_with_an_api_key_only_the_page_is_open(tiny_model_dir: Path) -> None:
    client = TestClient(create_app(settings_for(tiny_model_dir, api_key="sesame")))
    assert client.get("/").status_code == 200
    assert client.get("/playground/api.js").status_code == 200
    # POST / is TGI's generation route, not the page: it needs the key.
    assert client.post("/", json={"inputs": "x"}).status_code == 401
    for path in ("/info", "/openapi.json"):
        assert client.get(path).status_code == 401
    assert client.get("/info", headers={"Authorization": "Bearer sesame"}).status_code == 200
