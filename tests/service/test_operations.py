"""Operations: X-Request-Id (accepted, echoed, made when absent, carried into the logs),
--cors-origins (off by default) and --log-format json."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from tests.service.conftest import settings_for
from tests.service.live import live_server

ORIGIN = "http://notebook.example"


@pytest.fixture(scope="module")
def cors_client(tiny_model_dir):
    with TestClient(create_app(settings_for(tiny_model_dir, cors_origins=f"{ORIGIN}, http://other.example"))) as c:
        yield c


def test_request_id_is_echoed_or_made(client):
    given = client.get("/health", headers={"X-Request-Id": "my-id-123"})
    assert given.headers["x-request-id"] == "my-id-123"
    made = [client.get("/health").headers["x-request-id"] for _ in range(2)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", m) for m in made) and made[0] != made[1]
    # An id that cannot go into a header or a log line as it is gets replaced.
    bad = client.get("/health", headers={"X-Request-Id": "two words"}).headers["x-request-id"]
    assert bad != "two words" and re.fullmatch(r"[0-9a-f]{32}", bad)
    # Error answers carry it too.
    invalid = client.post("/generate", json={"inputs": ""}, headers={"X-Request-Id": "failing-1"})
    assert invalid.status_code == 422 and invalid.headers["x-request-id"] == "failing-1"


def test_cors_is_off_by_default(client):
    preflight = client.options(
        "/generate", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    )
    assert "access-control-allow-origin" not in preflight.headers
    assert "access-control-allow-origin" not in client.get("/health", headers={"Origin": ORIGIN}).headers


def test_cors_allows_the_configured_origins_only(cors_client):
    preflight = cors_client.options(
        "/v1/completions",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"},
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    answer = cors_client.get("/health", headers={"Origin": ORIGIN})
    assert answer.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in answer.headers["access-control-expose-headers"].lower()
    other = cors_client.get("/health", headers={"Origin": "http://elsewhere.example"})
    assert "access-control-allow-origin" not in other.headers


@pytest.mark.slow
def test_json_logs_name_the_request(tiny_model_dir):
    with live_server(tiny_model_dir, log_format="json") as server:
        response = httpx.post(server.url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
                              headers={"X-Request-Id": "trace-me-42"}, timeout=60)
        assert response.status_code == 200 and response.headers["x-request-id"] == "trace-me-42"
        server.process.terminate()
        output = server.log(wait_for_exit=True)
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert lines, output[-2000:]
    assert all({"time", "level", "logger", "message", "request_id"} <= set(line) for line in lines)
    access = [line for line in lines if line["logger"] == "uvicorn.access" and "/generate" in line["message"]]
    assert [line["request_id"] for line in access] == ["trace-me-42"]


@pytest.mark.slow
def test_no_access_log_leaves_out_the_line_per_request_only(tiny_model_dir):
    with live_server(tiny_model_dir, log_format="json", access_log=False) as server:
        response = httpx.post(server.url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
                              timeout=60)
        assert response.status_code == 200
        server.process.terminate()
        output = server.log(wait_for_exit=True)
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert not [line for line in lines if line["logger"] == "uvicorn.access"]
    assert any(line["logger"] == "uvicorn.error" and "Application startup complete" in line["message"] for line in lines)
