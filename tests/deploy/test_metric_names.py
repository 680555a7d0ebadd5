"""Every series the dashboard, the HPA and the adapter rules query is one the service exports:
each PromQL expression is parsed (promql-parser), and its selectors are compared with a live
scrape of the application on a tiny model."""

from __future__ import annotations

import pytest

from tests.deploy.deploy_files import (
    SCRAPE_LABELS, adapter_rules, dashboard_exprs, expand_grafana_macros, k8s_resources,
    render_adapter_query, selection,
)

# What the dashboard must show (issue 6): each family is read by at least one panel.
DASHBOARD_TOPICS = {
    "request rate and outcomes": "gpt2_requests_total",
    "time to first token": "gpt2_time_to_first_token_seconds_bucket",
    "inter-token latency": "gpt2_inter_token_latency_seconds_bucket",
    "generated tokens/s": "gpt2_generated_tokens_total",
    "queue": "gpt2_requests_waiting",
    "running requests": "gpt2_requests_running",
    "batch size": "gpt2_batch_size_bucket",
    "KV-cache usage": "gpt2_kv_cache_usage_ratio",
    "analysis latency": "gpt2_analysis_duration_seconds_bucket",
}


def autoscaling_exprs() -> list[str]:
    hpa = k8s_resources()["HorizontalPodAutoscaler"]
    exprs = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    for rule in adapter_rules():
        series = rule["seriesQuery"]
        exprs += [series, render_adapter_query(rule["metricsQuery"], selection(series).names.pop())]
    return exprs


def missing(exprs: list[str], exported: dict[str, set[str]]) -> list[str]:
    problems = []
    for expr in exprs:
        read = selection(expand_grafana_macros(expr))
        problems += [f"{expr}: no series {name}" for name in sorted(read.names - exported.keys())]
        for names, label in read.labels:
            carriers = set().union(*(exported.get(n, set()) for n in names))
            if label not in SCRAPE_LABELS | carriers:
                problems.append(f"{expr}: label {label!r} is on none of {sorted(names)}")
    return problems


def test_selection_reads_names_matchers_and_groupings():
    # Guards the comparison below: an empty selection would let any dashboard pass.
    read = selection('histogram_quantile(0.9, sum by (le, endpoint) (rate(a_bucket{outcome="x"}[1m]))) / sum(b)')
    assert read.names == {"a_bucket", "b"}
    assert read.labels == {
        (frozenset({"a_bucket"}), "outcome"), (frozenset({"a_bucket"}), "le"), (frozenset({"a_bucket"}), "endpoint"),
    }


def test_dashboard_queries_only_exported_series(scraped_series):
    exprs = dashboard_exprs()
    assert exprs, "the dashboard has no queries"
    assert not missing(exprs, scraped_series)


def test_autoscaling_reads_only_exported_series(scraped_series):
    assert not missing(autoscaling_exprs(), scraped_series)


def test_a_metric_the_service_lacks_is_reported(scraped_series):
    assert missing(["sum(rate(gpt2_no_such_metric_total[1m]))"], scraped_series)
    assert missing(['sum by (colour) (gpt2_requests_total{outcome="success"})'], scraped_series)


@pytest.mark.parametrize("topic", sorted(DASHBOARD_TOPICS))
def test_dashboard_shows(topic):
    read = set().union(*(selection(expand_grafana_macros(e)).names for e in dashboard_exprs()))
    assert DASHBOARD_TOPICS[topic] in read
