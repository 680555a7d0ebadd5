"""GET/POST /analyze/spectrum on an app serving the tiny model: the report, the figure, the limits."""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from model.analysis import analyze
from service.analysis import process as analysis_process
from service.analysis import report
from service.analysis.figure import MEAN_GID, SVG_MEDIA_TYPE
from service.analysis.remote import AnalysisClient
from tests.analysis.conftest import ANALYSIS_MAX_TOKENS, TEXTS
from tests.analysis.document_recipe import document_curve
from tests.conftest import TINY, assert_validation_error

URL = "/analyze/spectrum"
SVG_NS = "{http://www.w3.org/2000/svg}"
XLINK_HREF = "{http://www.w3.org/1999/xlink}href"


def means(report: dict) -> list[float]:
    return [entry["spectral_norm"]["mean"] for entry in report["layers"]]


def test_get_reports_the_document_figure_for_the_texts(client, tiny_document_model, document_tokenizer) -> None:
    response = client.get(URL, params={"text": TEXTS[:2]})
    assert response.status_code == 200, response.text
    report = response.json()
    expected = document_curve(tiny_document_model, [document_tokenizer(t)["input_ids"] for t in TEXTS[:2]])
    assert means(report) == pytest.approx(expected, rel=1e-4)
    assert report["method"] == "fast" and report["n_sequences"] == 2
    assert report["model"]["name"] == "tiny" and report["model"]["n_layer"] == TINY.n_layer
    assert len(report["rank_collapse"]) == TINY.n_layer + 1
    assert len(report["weight_spectra"]["query"]) == TINY.n_layer
    layer = report["layers"][0]
    assert set(layer["bounds"]) == {"lower", "colsum", "trivial", "prenorm", "seed_prenorm"}
    assert layer["bounds"]["seed_prenorm"]["valid"] is False and layer["bounds"]["prenorm"]["valid"] is True
    assert len(layer["spectral_norm"]["per_head_mean"]) == TINY.n_head


def test_post_texts_token_ids_and_get_agree(client, tokenizer) -> None:
    ids = tokenizer.encode_batch(TEXTS[:2])
    by_get = client.get(URL, params={"text": TEXTS[:2], "method": "exact"}).json()
    by_texts = client.post(URL, json={"texts": TEXTS[:2], "method": "exact"}).json()
    by_ids = client.post(URL, json={"token_ids": ids, "method": "exact"}).json()
    assert means(by_get) == means(by_texts) == means(by_ids)
    assert by_ids["n_tokens"] == [len(i) for i in ids]


def test_layers_select_what_is_measured(client) -> None:
    full = client.get(URL, params={"text": TEXTS[0], "method": "exact"}).json()
    for params in ({"layers": "2,0"}, {"layers": ["0", "2"]}):
        some = client.get(URL, params={"text": TEXTS[0], "method": "exact", **params}).json()
        assert [entry["layer"] for entry in some["layers"]] == [0, 2]
        assert means(some) == [means(full)[0], means(full)[2]]
    posted = client.post(URL, json={"texts": [TEXTS[0]], "layers": [1], "method": "exact"}).json()
    assert means(posted) == [means(full)[1]]


def test_svg_is_the_figure_with_one_point_per_layer(client) -> None:
    response = client.get(URL, params={"text": TEXTS[:3], "format": "svg"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith(SVG_MEDIA_TYPE)
    root = ET.fromstring(response.content)  # well-formed XML or this raises
    assert root.tag == f"{SVG_NS}svg"
    [mean_group] = [g for g in root.iter(f"{SVG_NS}g") if g.get("id") == MEAN_GID]
    markers = [use for use in mean_group.iter(f"{SVG_NS}use") if use.get(XLINK_HREF)]
    assert len(markers) == TINY.n_layer
    text = "".join(root.itertext())
    assert "layer" in text and "spectral norm" in text
    posted = client.post(URL, json={"texts": TEXTS[:1], "layers": [0, 1], "format": "svg"})
    [group] = [g for g in ET.fromstring(posted.content).iter(f"{SVG_NS}g") if g.get("id") == MEAN_GID]
    assert len([use for use in group.iter(f"{SVG_NS}use")]) == 2


@pytest.mark.parametrize(
    "request_kwargs,words",
    [
        ({"params": {"text": ["a"] * 5}}, ("5 texts", "at most 4")),
        ({"params": {"text": "word" + " word" * ANALYSIS_MAX_TOKENS}}, ("text[0]", f"{ANALYSIS_MAX_TOKENS + 1} tokens", f"at most {ANALYSIS_MAX_TOKENS}")),
        ({"params": {"text": ["fine", ""]}}, ("text[1]", "no tokens")),
        ({"params": {"text": "x", "layers": "0,7"}}, ("[7]", "layers 0 to 2")),
        ({"params": {"text": "x", "layers": "one"}}, ("layers must be integers",)),
        ({"params": {"text": "x", "method": "svd"}}, ("method",)),
        ({"params": {"text": "x", "format": "png"}}, ("format",)),
        ({"params": {}}, ("text",)),
        ({"json": {"texts": ["a"], "token_ids": [[1]]}}, ("exactly one of texts or token_ids",)),
        ({"json": {}}, ("exactly one of texts or token_ids",)),
        ({"json": {"token_ids": [[1, TINY.vocab_size]]}}, ("token_ids[0]", str(TINY.vocab_size), "vocabulary")),
        ({"json": {"token_ids": [[1], []]}}, ("token_ids[1]", "no tokens")),
        ({"json": {"texts": ["a"], "layers": []}}, ("layers is empty",)),
        ({"json": {"texts": ["a"], "colour": "red"}}, ("colour",)),
        ({"json": {"texts": ["a"], "compare": True}}, ("compare", "no comparison model", "--compare-model-dir")),
    ],
)
def test_bad_input_is_a_422_saying_what_is_wrong(client, request_kwargs, words) -> None:
    method = client.post if "json" in request_kwargs else client.get
    assert_validation_error(method(URL, **request_kwargs), *words)
    # Nothing was left holding the analysis slot.
    assert client.get(URL, params={"text": "still served", "layers": "0"}).status_code == 200


def test_over_the_concurrency_limit_is_429_then_served_again(client, app) -> None:
    client.get(URL, params={"text": "make the gate", "layers": "0"})
    gate = app.state.analysis_gate
    assert gate.acquire(blocking=False)  # the one slot (analysis_max_concurrent=1) is now busy
    try:
        response = client.get(URL, params={"text": "one too many"})
        assert response.status_code == 429
        assert response.json()["error_type"] == "overloaded"
        assert "Retry-After" in response.headers
    finally:
        gate.release()
    assert client.get(URL, params={"text": "one too many", "layers": "0"}).status_code == 200


def test_analysis_runs_in_the_analysis_process_not_here(client, app, monkeypatch) -> None:
    # Were it computed in this (the HTTP) process, the patched functions would fail it.
    for module in (report, analysis_process):
        monkeypatch.setattr(module, "reports", lambda *a: pytest.fail("analysed in the HTTP process"))
    assert client.get(URL, params={"text": "where", "layers": "0"}).status_code == 200
    pid = app.state.analysis.pid
    assert pid is not None and pid != os.getpid()
    assert Path(f"/proc/{pid}/comm").read_text().strip() == "gpt2-analysis"


def test_requests_and_durations_are_counted(client) -> None:
    def counts() -> dict:
        samples = {}
        for family in text_string_to_metric_families(client.get("/metrics").text):
            for sample in family.samples:
                if sample.name == "gpt2_requests_total" and sample.labels.get("endpoint") == URL:
                    samples[sample.labels["outcome"]] = sample.value
                if sample.name == "gpt2_analysis_duration_seconds_count":
                    samples["durations"] = sample.value
        return samples

    before = counts()
    client.get(URL, params={"text": "counted", "layers": "0"})
    client.get(URL, params={"text": "x", "layers": "9"})
    after = counts()
    assert after["success"] == before["success"] + 1
    assert after["validation"] == before["validation"] + 1
    assert after["durations"] == before["durations"] + 1


def test_svg_without_matplotlib_is_a_422_before_any_work(client, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without it looks like
    monkeypatch.setattr(AnalysisClient, "call", lambda *a: pytest.fail("sent for a figure it cannot draw"))
    assert_validation_error(client.get(URL, params={"text": "x", "format": "svg"}), "matplotlib", "not installed")
    monkeypatch.undo()
    assert client.get(URL, params={"text": "x", "format": "svg", "layers": "0"}).status_code == 200


def test_one_request_returns_both_models_curves(compare_client, tiny_model, tiny_post_ln_model, tokenizer) -> None:
    response = compare_client.post(URL, json={"texts": TEXTS[:2]})
    assert response.status_code == 200, response.text
    body = response.json()
    ids = tokenizer.encode_batch(TEXTS[:2])
    assert body["model"]["name"] == "tiny" and body["model"]["architecture"] == "pre-ln"
    [other] = body["compare"]
    assert other["model"]["name"] == "tiny-post-ln" and other["model"]["architecture"] == "post-ln"
    assert means(body) == pytest.approx(means(analyze(tiny_model, ids, "fast").to_dict()), rel=1e-4)
    assert means(other) == pytest.approx(means(analyze(tiny_post_ln_model, ids, "fast").to_dict()), rel=1e-4)
    assert means(body) != pytest.approx(means(other), rel=1e-3)  # two models, two curves
    alone = compare_client.post(URL, json={"texts": TEXTS[:2], "compare": False}).json()
    assert "compare" not in alone and means(alone) == pytest.approx(means(body), rel=1e-6)


def test_the_comparison_figure_draws_both_curves(compare_client) -> None:
    response = compare_client.get(URL, params={"text": TEXTS[:2], "format": "svg"})
    assert response.status_code == 200
    root = ET.fromstring(response.content)
    for gid in (MEAN_GID, f"{MEAN_GID}-1"):
        [group] = [g for g in root.iter(f"{SVG_NS}g") if g.get("id") == gid]
        assert len([use for use in group.iter(f"{SVG_NS}use") if use.get(XLINK_HREF)]) == TINY.n_layer
    assert "tiny-post-ln" in "".join(root.itertext())


def fast_matrices(client) -> dict[str, float]:
    return {
        sample.labels["result"]: sample.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for sample in family.samples
        if sample.name == "gpt2_analysis_fast_matrices_total"
    }


def test_the_fast_methods_fallbacks_are_reported_and_counted(compare_client) -> None:
    full = list(range(TINY.n_positions))
    before = fast_matrices(compare_client)
    response = compare_client.post(URL, json={"token_ids": [full], "layers": [0], "compare": False})
    assert response.status_code == 200
    # 128 tokens: long enough for the fast method's iteration on every head, which certifies all
    # four here (tests/analysis/test_spectral.py holds the count on a realistic set).
    assert response.json()["fast_method"] == {"iterated": TINY.n_head, "fallbacks": 0}
    exact = compare_client.post(URL, json={"token_ids": [full], "layers": [0], "compare": False, "method": "exact"})
    assert exact.json()["fast_method"] is None
    figure = compare_client.post(URL, json={"token_ids": [full], "layers": [0], "compare": False, "format": "svg"})
    assert figure.status_code == 200
    after = fast_matrices(compare_client)
    assert after["certified"] == before["certified"] + 2 * TINY.n_head  # the JSON and the SVG answer
    assert after["fallback"] == before["fallback"]


def test_default_per_text_limit_is_the_model_context(compare_client) -> None:
    full = list(range(TINY.n_positions))
    assert compare_client.post(URL, json={"token_ids": [full], "layers": [0], "compare": False}).status_code == 200
    assert_validation_error(
        compare_client.post(URL, json={"token_ids": [full + [1]], "layers": [0]}),
        "token_ids[0]", f"{TINY.n_positions + 1} tokens", f"at most {TINY.n_positions}",
    )
