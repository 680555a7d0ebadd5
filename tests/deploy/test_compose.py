"""docker-compose.yml and the files it mounts: the compose specification's schema, HAProxy's and
Prometheus' own config checkers, and agreement on names, ports, paths and routes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import PurePosixPath

import pytest
import yaml

from service.settings import Settings
from tests.deploy.deploy_files import (
    COMPOSE_FILE, DASHBOARD, DEPLOY, HAPROXY_CONFIG, PROMETHEUS_CONFIG, REPO, compose, load_yaml, require_tool,
)

MODEL_SERVICES = ("gpt2", "gpt2-cpu")
# Variables read by the image's entrypoint rather than by service/settings.py.
ENTRYPOINT_VARIABLES = {"GPT2_PREPARE_ARGS"}


def service(name: str) -> dict:
    return compose()["services"][name]


def bind_mounts(name: str) -> dict[str, str]:
    """Container path -> repository path, for the service's mounts of repository files."""
    mounts = {}
    for volume in service(name).get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            mounts[target] = source
    return mounts


def named_volume_target(name: str, volume: str) -> str:
    return next(v.split(":")[1] for v in service(name)["volumes"] if v.split(":")[0] == volume)


def test_compose_file_follows_the_compose_specification():
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_schema_check_rejects_a_broken_file(tmp_path):
    # The check above must be able to fail: a misspelt service key is refused.
    broken = compose()
    broken["services"]["gpt2"]["enviroment"] = broken["services"]["gpt2"].pop("environment")
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True, text=True,
    )
    assert result.returncode != 0


def test_every_mounted_file_and_build_context_exists():
    for name, definition in compose()["services"].items():
        for source in bind_mounts(name).values():
            assert (REPO / source).exists(), f"{name} mounts {source}, which does not exist"
        if "build" in definition:
            assert (REPO / definition["build"]["context"] / definition["build"]["dockerfile"]).is_file()


def test_gpu_profile_reserves_an_nvidia_gpu_and_cpu_profile_runs_without_one():
    gpu, cpu = service("gpt2"), service("gpt2-cpu")
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices and all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "resources" not in cpu.get("deploy", {})
    for definition, variant in ((gpu, "cuda"), (cpu, "cpu")):
        assert definition["build"]["args"]["VARIANT"] == variant
        assert definition["environment"]["GPT2_DEVICE"] == variant


def test_model_services_read_only_settings_that_exist():
    for name in MODEL_SERVICES:
        variables = {k for k in service(name)["environment"] if k.startswith("GPT2_")} - ENTRYPOINT_VARIABLES
        unknown = {v for v in variables if v.removeprefix("GPT2_").lower() not in Settings.model_fields}
        assert not unknown, f"{name} sets variables service/settings.py does not read: {unknown}"


def test_model_volume_is_mounted_at_the_parent_of_the_model_folder():
    # weights.prepare builds next to the model folder and renames it into place: the folder must
    # sit inside the volume, not be its mount point.
    for name in MODEL_SERVICES:
        model_dir = PurePosixPath(service(name)["environment"]["GPT2_MODEL_DIR"])
        assert named_volume_target(name, "models") == str(model_dir.parent)


def test_only_the_load_balancer_publishes_the_api_port():
    for name in MODEL_SERVICES:
        assert "ports" not in service(name), f"{name}: a host port would stop it from scaling to replicas"
        assert service(name)["environment"]["GPT2_PORT"] == "8000"
    assert any(str(p).endswith(":8000") for p in service("lb")["ports"])


def haproxy_lines() -> list[list[str]]:
    lines = (line.split("#", 1)[0].split() for line in HAPROXY_CONFIG.read_text().splitlines())
    return [line for line in lines if line]


def test_haproxy_accepts_its_config():
    haproxy = require_tool("haproxy")
    result = subprocess.run([haproxy, "-c", "-f", str(HAPROXY_CONFIG)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_load_balancer_sends_to_the_model_services_and_checks_a_route_that_answers(get_status):
    assert bind_mounts("lb") == {"/usr/local/etc/haproxy/haproxy.cfg": "./" + HAPROXY_CONFIG.relative_to(REPO).as_posix()}
    lines = haproxy_lines()
    templates = [line for line in lines if line[0] == "server-template"]
    targets = {tuple(line[3].split(":")) for line in templates}
    assert targets == {(name, service(name)["environment"]["GPT2_PORT"]) for name in MODEL_SERVICES}
    check = next(line for line in lines if line[:2] == ["option", "httpchk"])
    assert get_status(check[-1]) == 200
    assert ["bind", ":8000"] in lines
    # A compressing or request-buffering proxy would hold SSE tokens back.
    assert not any(line[0] == "compression" for line in lines)


def test_promtool_accepts_the_prometheus_config():
    promtool = require_tool("promtool")
    result = subprocess.run([promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_every_replica_on_the_metrics_route(get_status):
    assert bind_mounts("prometheus")["/etc/prometheus/prometheus.yml"] == "./" + PROMETHEUS_CONFIG.relative_to(REPO).as_posix()
    assert "--config.file=/etc/prometheus/prometheus.yml" in service("prometheus")["command"]
    job = next(j for j in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"] if j["job_name"] == "gpt2")
    assert get_status(job["metrics_path"]) == 200
    (discovery,) = job["dns_sd_configs"]
    assert set(discovery["names"]) == set(MODEL_SERVICES)
    assert all(str(discovery["port"]) == service(name)["environment"]["GPT2_PORT"] for name in MODEL_SERVICES)


def test_grafana_provisioning_wires_the_datasource_and_the_dashboard():
    mounts = bind_mounts("grafana")
    provisioning = REPO / mounts["/etc/grafana/provisioning"]
    assert provisioning == DEPLOY / "grafana" / "provisioning"
    (datasource,) = load_yaml(provisioning / "datasources" / "prometheus.yml")["datasources"]
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", datasource["url"]).groups()
    assert host == "prometheus" and any(str(p).endswith(f":{port}") for p in service("prometheus")["ports"])

    (provider,) = load_yaml(provisioning / "dashboards" / "gpt2-serve.yml")["providers"]
    dashboards_dir = REPO / mounts[provider["options"]["path"]]
    assert DASHBOARD.parent == dashboards_dir
    home = PurePosixPath(service("grafana")["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert (dashboards_dir / home.relative_to(provider["options"]["path"])).is_file()

    dashboard = json.loads(DASHBOARD.read_text())
    used = {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p}
    used |= {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert used == {datasource["uid"]}


@pytest.mark.parametrize("name", ["lb", "prometheus", "grafana"])
def test_third_party_images_are_pinned(name):
    image = service(name)["image"]
    assert ":" in image and not image.endswith(":latest")


def published_addresses(name: str) -> list[str]:
    """The host address of each published port, with `${VAR:-default}` at its default."""
    ports = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(p)) for p in service(name).get("ports", [])]
    return [p.rsplit(":", 2)[0] if p.count(":") == 2 else "0.0.0.0" for p in ports]


@pytest.mark.parametrize("name", ["lb", "prometheus", "grafana"])
def test_nothing_is_published_beyond_loopback_by_default(name):
    # A keyless API or an admin UI on every interface is open to the whole network.
    assert published_addresses(name) and all(a == "127.0.0.1" for a in published_addresses(name))


def test_grafana_has_no_default_password_nor_anonymous_viewers():
    environment = service("grafana")["environment"]
    # ${VAR:?message}: compose refuses to start without it, rather than fall back to admin/admin.
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", environment["GF_SECURITY_ADMIN_PASSWORD"])
    assert environment.get("GF_AUTH_ANONYMOUS_ENABLED", "false") == "false"
