"""Kubernetes manifests: Kubernetes' own OpenAPI schemas (kubernetes-validate, strict), kustomize
when kubectl is there, and agreement with the image, the routes and each other."""

from __future__ import annotations

import re
import subprocess
from pathlib import PurePosixPath

import kubernetes_validate
import promql_parser
import pytest

from service.settings import Settings
from tests.deploy.deploy_files import (
    DOCKERFILE, K8S, REPO, adapter_rules, k8s_resources, load_yaml, render_adapter_query, require_tool,
)

RESOURCES = k8s_resources()
DEPLOYMENT = RESOURCES["Deployment"]
POD = DEPLOYMENT["spec"]["template"]
(CONTAINER,) = POD["spec"]["containers"]
CONTAINER_ENV = {e["name"]: e["value"] for e in CONTAINER["env"]}
ENTRYPOINT_SCRIPT = REPO / "service" / "deploy" / "docker" / "entrypoint.sh"


@pytest.mark.parametrize("kind", sorted(RESOURCES))
def test_manifest_follows_the_kubernetes_schema(kind):
    kubernetes_validate.validate(RESOURCES[kind], kubernetes_validate.latest_version(), strict=True)


def test_schema_check_rejects_a_misspelt_field():
    broken = {**DEPLOYMENT, "spec": {**DEPLOYMENT["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_kustomize_builds_every_resource():
    kubectl = require_tool("kubectl")
    built = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    kinds = re.findall(r"^kind: (\w+)$", built.stdout, re.M)
    assert sorted(kinds) == sorted(RESOURCES)


def test_deployment_requests_a_gpu_and_serves_on_it():
    assert CONTAINER["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert CONTAINER_ENV["GPT2_DEVICE"] == "cuda"
    unknown = {k for k in CONTAINER_ENV if k.removeprefix("GPT2_").lower() not in Settings.model_fields}
    assert not unknown, f"variables service/settings.py does not read: {unknown}"


def test_probes_hit_real_routes_on_the_served_port(get_status):
    (port,) = CONTAINER["ports"]
    assert str(port["containerPort"]) == CONTAINER_ENV["GPT2_PORT"]
    assert CONTAINER_ENV["GPT2_HOST"] == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = CONTAINER[probe]["httpGet"]
        assert get_status(check["path"]) == 200, f"{probe}: GET {check['path']} does not answer 200"
        assert check["port"] == port["name"]
    annotations = POD["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port["containerPort"])
    assert get_status(annotations["prometheus.io/path"]) == 200


def test_pods_run_as_the_images_user():
    uid = re.search(r"^USER (\d+)", DOCKERFILE.read_text(), re.M).group(1)
    security = POD["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    assert str(security["runAsUser"]) == uid and str(security["fsGroup"]) == uid


def test_init_container_prepares_the_shared_model_volume():
    (init,) = POD["spec"]["initContainers"]
    assert init["image"] == CONTAINER["image"]
    assert init["args"] == ["--prepare-only"] and '"--prepare-only"' in ENTRYPOINT_SCRIPT.read_text()
    model_dir = PurePosixPath(CONTAINER_ENV["GPT2_MODEL_DIR"])
    assert {e["name"]: e["value"] for e in init["env"]}["GPT2_MODEL_DIR"] == str(model_dir)
    for container, read_only in ((init, False), (CONTAINER, True)):
        (mount,) = container["volumeMounts"]
        # The folder sits inside the volume: weights.prepare renames a sibling into place.
        assert mount["mountPath"] == str(model_dir.parent)
        assert mount.get("readOnly", False) is read_only
    (volume,) = POD["spec"]["volumes"]
    assert volume["name"] == mount["name"]
    assert volume["persistentVolumeClaim"]["claimName"] == RESOURCES["PersistentVolumeClaim"]["metadata"]["name"]


def test_grace_period_outlasts_the_drain():
    drain = float(CONTAINER_ENV["GPT2_DRAIN_SECONDS"])
    assert POD["spec"]["terminationGracePeriodSeconds"] > drain


def test_service_and_ingress_reach_the_pods():
    svc = RESOURCES["Service"]
    assert svc["spec"]["selector"].items() <= POD["metadata"]["labels"].items()
    assert DEPLOYMENT["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    container_ports = {p["name"] for p in CONTAINER["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= container_ports
    (rule,) = RESOURCES["Ingress"]["spec"]["rules"]
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == svc["metadata"]["name"]
    assert backend["port"]["name"] in {p["name"] for p in svc["spec"]["ports"]}
    # SSE: a buffering proxy would deliver the tokens all at once at the end.
    assert RESOURCES["Ingress"]["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"


def test_hpa_scales_the_deployment_on_metrics_the_adapter_publishes():
    hpa = RESOURCES["HorizontalPodAutoscaler"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", DEPLOYMENT["metadata"]["name"])
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert names[0] == "gpt2_requests_waiting"
    assert set(names) <= {rule["name"]["as"] for rule in adapter_rules()}


@pytest.mark.parametrize("rule", adapter_rules(), ids=lambda r: r["name"]["as"])
def test_adapter_rule_queries_parse_and_map_pods(rule):
    series = promql_parser.parse(rule["seriesQuery"])
    assert isinstance(series, promql_parser.VectorSelector)
    assert re.fullmatch(rule["name"]["matches"], series.name)
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    promql_parser.parse(render_adapter_query(rule["metricsQuery"], series.name))


def test_optional_pod_monitor_scrapes_the_named_port(get_status):
    monitor = load_yaml(K8S / "optional" / "podmonitor.yaml")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= POD["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in CONTAINER["ports"]}
    assert get_status(endpoint["path"]) == 200
