"""--allowed-hosts: Starlette's TrustedHostMiddleware decides, refusals come in the service's JSON
error shape (the live check against a server bound to loopback is in tests/reliability)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from starlette.responses import PlainTextResponse

from service.http.request_guards import LOOPBACK_HOSTS, HostAllowListMiddleware
from service.settings import Settings


def guarded(allowed_hosts: str) -> TestClient:
    return TestClient(HostAllowListMiddleware(PlainTextResponse("served"), allowed_hosts=allowed_hosts))


def get(client: TestClient, host: str | None):
    headers = {"Host": host} if host is not None else {}
    return client.get("/health", headers=headers)


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "LOCALHOST", "127.0.0.1:80", "[::1]", "[::1]:8000"])
def test_loopback_names_are_served(host):
    response = get(guarded(",".join(LOOPBACK_HOSTS)), host)
    assert response.status_code == 200 and response.text == "served", host


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8000", "localhost.attacker.example",
                                  "[::2]:8000", "::1", "127.0.0.1:80:80", ""])
def test_other_names_are_refused_in_the_json_error_shape(host):
    response = get(guarded(",".join(LOOPBACK_HOSTS)), host)
    assert response.status_code == 400, host
    body = response.json()
    assert body["error_type"] == "validation"
    assert repr(host) in body["error"] and "allowed: 127.0.0.1, [::1], localhost" in body["error"]


def test_subdomain_wildcards_and_any():
    subdomains = guarded("*.example.com, api.test")
    assert get(subdomains, "a.example.com:443").status_code == 200
    assert get(subdomains, "API.test").status_code == 200
    assert get(subdomains, "example.org").status_code == 400
    assert get(guarded("*"), "anything.example").status_code == 200


@pytest.mark.parametrize("pattern", ["a*.example.com", "*example.com", "example.*"])
def test_misplaced_wildcards_are_refused_at_start(pattern):
    with pytest.raises(ValidationError, match="allowed_hosts"):
        Settings(allowed_hosts=f"localhost,{pattern}")
