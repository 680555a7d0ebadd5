"""Shared by the deployment tests: where the files are, how to read them, what PromQL selects."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "service" / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
HAPROXY_CONFIG = DEPLOY / "haproxy" / "haproxy.cfg"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "gpt2-serve.json"
ADAPTER_VALUES = K8S / "prometheus-adapter" / "values.yaml"

# Labels a series gains from the scrape, not from the service: Prometheus adds job and
# instance; Kubernetes service discovery adds namespace and pod.
SCRAPE_LABELS = frozenset({"job", "instance", "namespace", "pod"})

# Grafana replaces its macros before Prometheus sees a query; any valid duration stands in here.
GRAFANA_MACROS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"`{name}` is not installed (`make system-deps` installs Debian's package)")
    return path


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def compose() -> dict:
    return load_yaml(COMPOSE_FILE)


def k8s_resources() -> dict[str, dict]:
    """The resources kustomization.yaml applies, by kind."""
    kustomization = load_yaml(K8S / "kustomization.yaml")
    docs = [load_yaml(K8S / name) for name in kustomization["resources"]]
    return {doc["kind"]: doc for doc in docs}


def adapter_rules() -> list[dict]:
    """The Prometheus adapter's rules, from its Helm values."""
    return load_yaml(ADAPTER_VALUES)["rules"]["custom"]


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", []) if t.get("expr")]


def expand_grafana_macros(expr: str) -> str:
    for macro, value in GRAFANA_MACROS.items():
        expr = expr.replace(macro, value)
    return expr


def render_adapter_query(template: str, series: str) -> str:
    """The PromQL the Prometheus adapter sends for one pod (its Go template placeholders filled)."""
    return (
        template.replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", 'namespace="gpt2-serve",pod="gpt2-0"')
        .replace("<<.GroupBy>>", "pod")
    )


@dataclass
class Selection:
    """What one PromQL expression reads: series names, and the labels it matches or groups by."""

    names: set[str] = field(default_factory=set)
    # (the series the label may come from, the label)
    labels: set[tuple[frozenset[str], str]] = field(default_factory=set)


def selection(expr: str) -> Selection:
    found = Selection()

    def names_under(node) -> set[str]:
        names: set[str] = set()

        def visit(inner):
            if isinstance(inner, promql_parser.VectorSelector):
                names.add(inner.name)

        promql_parser.walk(node, visit)
        return names

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            found.names.add(node.name)
            for matcher in node.matchers.matchers:
                found.labels.add((frozenset({node.name}), matcher.name))
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            # A `by (label)` must name a label of at least one series it aggregates.
            if node.modifier.type == promql_parser.AggModifierType.By:
                for label in node.modifier.labels:
                    found.labels.add((frozenset(names_under(node.expr)), label))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def exported_series(exposition: str) -> dict[str, set[str]]:
    """Every series name a Prometheus scrape of this text creates, with its label names.

    Families declared without samples yet (a labelled metric nobody recorded) count too, with the
    names Prometheus would give their samples.
    """
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "info": ("_info",)}
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        for suffix in suffixes.get(family.type, ("",)):
            series.setdefault(family.name + suffix, set())
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series
