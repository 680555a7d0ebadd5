"""Deployments that expose the API keep the playground off unless asked: the compose file and
the Kubernetes Deployment set GPT2_PLAYGROUND to false, and the service reads that as off."""

from __future__ import annotations

import re

from service.settings import Settings
from tests.deploy.deploy_files import compose, k8s_resources


def served_with(value: str, monkeypatch) -> bool:
    monkeypatch.setenv("GPT2_PLAYGROUND", value)
    return Settings().playground


def test_compose_keeps_the_playground_off_unless_asked(monkeypatch):
    services = compose()["services"]
    model_services = [name for name, s in services.items() if "GPT2_MODEL_DIR" in s.get("environment", {})]
    assert model_services
    for name in model_services:
        value = services[name]["environment"]["GPT2_PLAYGROUND"]
        default = re.fullmatch(r"\$\{GPT2_PLAYGROUND:-(\w+)\}", value)
        assert default, f"{name}: GPT2_PLAYGROUND must be overridable from the shell, got {value!r}"
        assert served_with(default.group(1), monkeypatch) is False
    assert served_with("true", monkeypatch) is True


def test_kubernetes_deployment_keeps_the_playground_off(monkeypatch):
    containers = k8s_resources()["Deployment"]["spec"]["template"]["spec"]["containers"]
    for container in containers:
        env = {variable["name"]: variable["value"] for variable in container["env"]}
        assert served_with(env["GPT2_PLAYGROUND"], monkeypatch) is False
