"""The analysis of a LoRA fine-tune: the spectra of the model with an adapter applied (its merged
weights, its forward), beside its base; adapters named per request, loaded and unloaded at run time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from model.analysis import analyze
from model.attention_bounds import weight_spectra
from model.introspect import attention_maps, logit_lens
from model.lora import LoraSet
from service.analysis.cli import main as cli_main
from service.app import create_app
from service.settings import Settings
from tests.analysis.conftest import TEXTS
from tests.conftest import TINY
from weights.checkpoint import load_model

peft = pytest.importorskip("peft")
from tests.model.test_lora import PEFT_CONFIGS, load_reference_model, peft_adapter  # noqa: E402

URL = "/analyze/spectrum"
ADAPTER = "poems"


def means(report: dict) -> list[float]:
    return [entry["spectral_norm"]["mean"] for entry in report["layers"]]


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    return peft_adapter(tmp_path_factory.mktemp("adapter"), tiny_model_dir, seed=3, **PEFT_CONFIGS["all-modules"])


@pytest.fixture(scope="module")
def other_adapter_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    return peft_adapter(tmp_path_factory.mktemp("other"), tiny_model_dir, seed=4, **PEFT_CONFIGS["attention-only"])


@pytest.fixture(scope="module")
def peft_merged_dir(tiny_model_dir: Path, adapter_dir: Path, tmp_path_factory) -> Path:
    """peft's own merge of the adapter into transformers' GPT-2, saved as a model folder."""
    merged = peft.PeftModel.from_pretrained(load_reference_model(tiny_model_dir), adapter_dir).merge_and_unload()
    out = tmp_path_factory.mktemp("merged")
    merged.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def applied(tiny_model_dir: Path, adapter_dir: Path):
    model = load_model(tiny_model_dir)
    adapters = LoraSet(model)
    adapters.load(ADAPTER, adapter_dir)
    return model, adapters.applied(ADAPTER)


def test_merged_spectra_equal_peft_merged_models(applied, peft_merged_dir) -> None:
    model, adapter = applied
    ours = analyze(model, [list(range(5, 30))], "exact", adapter=adapter)
    merged = load_model(peft_merged_dir)
    theirs = analyze(merged, [list(range(5, 30))], "exact")
    for name in ("query", "key", "value", "attn_proj", "mlp_fc", "mlp_proj", "logit_bound"):
        assert torch.allclose(getattr(ours.weights, name), getattr(theirs.weights, name), rtol=1e-5), name
    # The forward with lora= measures what the merged model's forward does.
    assert means(ours.to_dict()) == pytest.approx(means(theirs.to_dict()), rel=1e-4)


def test_the_adapter_changes_the_spectra_and_the_base_keeps_its_own(applied, tiny_model_dir) -> None:
    model, adapter = applied
    ids = [list(range(5, 30))]
    fresh = load_model(tiny_model_dir)
    base_before = analyze(fresh, ids, "exact")
    adapted = analyze(model, ids, "exact", adapter=adapter)
    base = analyze(model, ids, "exact")  # the same model object, with the adapter resident
    assert means(base.to_dict()) == means(base_before.to_dict())
    assert torch.equal(base.weights.query, base_before.weights.query)
    assert not torch.allclose(adapted.weights.query, base.weights.query, rtol=1e-3)
    assert means(adapted.to_dict()) != pytest.approx(means(base.to_dict()), rel=1e-3)
    plain = weight_spectra(model)  # the merged weights never replaced the model's own
    assert torch.equal(plain.mlp_fc, base_before.weights.mlp_fc)


def test_inspections_use_the_adapter(applied) -> None:
    model, adapter = applied
    ids = list(range(5, 20))
    assert not torch.allclose(attention_maps(model, ids, [0, 1], adapter), attention_maps(model, ids, [0, 1]), atol=1e-4)
    with_adapter, without = logit_lens(model, ids, 3, adapter), logit_lens(model, ids, 3)
    assert not torch.allclose(with_adapter.logprobs[-1], without.logprobs[-1], atol=1e-4)
    # Layer 0 of the lens is the embeddings, which no adapter touches.
    assert torch.equal(with_adapter.logprobs[0], without.logprobs[0])


@pytest.fixture(scope="module")
def lora_client(tiny_model_dir: Path, adapter_dir: Path, device):
    settings = Settings(
        model_dir=tiny_model_dir, model_name="tiny", threads=1, max_batch_size=2, device=device.type,
        analysis_max_concurrent=1, lora=[f"{ADAPTER}={adapter_dir}"],
    )
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def test_routes_apply_the_adapter_named(lora_client, applied, tokenizer) -> None:
    model, adapter = applied
    ids = tokenizer.encode_batch(TEXTS[:2])
    base = lora_client.post(URL, json={"texts": TEXTS[:2]}).json()
    tuned = lora_client.post(URL, json={"texts": TEXTS[:2], "adapter": ADAPTER}).json()
    by_get = lora_client.get(URL, params={"text": TEXTS[:2], "adapter": ADAPTER}).json()
    assert tuned["model"]["adapter"] == ADAPTER and base["model"]["adapter"] is None
    assert means(tuned) == pytest.approx(means(analyze(model, ids, "fast", adapter=adapter).to_dict()), rel=1e-4)
    assert means(by_get) == means(tuned)
    assert means(base) == pytest.approx(means(analyze(model, ids, "fast").to_dict()), rel=1e-4)
    assert tuned["weight_spectra"]["query"] != base["weight_spectra"]["query"]

    short = tokenizer.encode(TEXTS[0])
    attention = lora_client.post("/analyze/attention", json={"text": TEXTS[0], "layers": [1], "adapter": ADAPTER}).json()
    expected = attention_maps(model, short, [1], adapter)[0]
    assert torch.allclose(torch.tensor(attention["layers"][0]["attention"]), expected, atol=1e-5)
    assert attention["adapter"] == ADAPTER
    lens = lora_client.post("/analyze/logit-lens", json={"text": TEXTS[0], "top_k": 1, "adapter": ADAPTER}).json()
    assert [p[0]["id"] for p in lens["layers"][-1]["top"]] == logit_lens(model, short, 1, adapter).ids[-1, :, 0].tolist()


def test_compare_base_sets_the_fine_tune_beside_its_base(lora_client) -> None:
    body = lora_client.get(URL, params={"text": TEXTS[:2], "adapter": ADAPTER, "compare": "base"}).json()
    [base] = body["compare"]
    assert body["model"]["adapter"] == ADAPTER and base["model"]["adapter"] is None
    assert means(base) == means(lora_client.get(URL, params={"text": TEXTS[:2]}).json())
    assert means(body) == means(lora_client.get(URL, params={"text": TEXTS[:2], "adapter": ADAPTER}).json())
    assert means(body) != pytest.approx(means(base), rel=1e-3)
    figure = lora_client.get(URL, params={"text": TEXTS[:2], "adapter": ADAPTER, "compare": "base", "format": "svg"})
    assert figure.status_code == 200 and f"tiny + {ADAPTER}" in figure.text
    no_adapter = lora_client.get(URL, params={"text": "x", "compare": "base"})
    assert no_adapter.status_code == 422 and "adapter" in no_adapter.json()["error"]
    plain = lora_client.get(URL, params={"text": "x", "compare": "false"})
    assert plain.status_code == 200 and "compare" not in plain.json()


@pytest.mark.parametrize("path,body", [
    (URL, {"texts": ["x"]}), ("/analyze/attention", {"text": "x"}), ("/analyze/logit-lens", {"text": "x"}),
])
def test_an_unknown_adapter_is_a_404_naming_it(lora_client, path, body) -> None:
    response = lora_client.post(path, json={**body, "adapter": "sonnets"})
    assert response.status_code == 404, response.text
    assert response.json()["error_type"] == "not_found" and "'sonnets'" in response.json()["error"]


def test_adapters_load_and_unload_at_run_time_through_the_client(lora_client, app_analysis, other_adapter_dir, tmp_path) -> None:
    call = lora_client.portal.call
    assert lora_client.get("/analyze/adapters").json() == {"adapters": [ADAPTER]}
    with pytest.raises(ValueError, match="adapter_config.json"):
        call(app_analysis.load_adapter, "broken", str(tmp_path))
    with pytest.raises(ValueError, match="already loaded"):
        call(app_analysis.load_adapter, ADAPTER, str(other_adapter_dir))
    call(app_analysis.load_adapter, "other", str(other_adapter_dir))
    assert lora_client.get("/analyze/adapters").json() == {"adapters": [ADAPTER, "other"]}
    other = lora_client.post(URL, json={"texts": ["a text"], "adapter": "other"})
    first = lora_client.post(URL, json={"texts": ["a text"], "adapter": ADAPTER})
    assert other.status_code == 200 and means(other.json()) != means(first.json())
    call(app_analysis.unload_adapter, "other")
    assert lora_client.post(URL, json={"texts": ["a text"], "adapter": "other"}).status_code == 404
    with pytest.raises(ValueError, match="'other'"):
        call(app_analysis.unload_adapter, "other")
    # Its index is free again: a reload serves the same numbers.
    call(app_analysis.load_adapter, "other", str(other_adapter_dir))
    assert means(lora_client.post(URL, json={"texts": ["a text"], "adapter": "other"}).json()) == means(other.json())
    call(app_analysis.unload_adapter, "other")


@pytest.fixture
def app_analysis(lora_client):
    return lora_client.app.state.analysis


def test_cli_draws_the_fine_tune_beside_its_base(tmp_path, tiny_model_dir, adapter_dir, applied, tokenizer, capsys) -> None:
    model, adapter = applied
    source = tmp_path / "texts.json"
    source.write_text(json.dumps(TEXTS[:2]))
    out_json, out_svg = tmp_path / "report.json", tmp_path / "figure.svg"
    cli_main(["--model-dir", str(tiny_model_dir), "--lora", f"{ADAPTER}={adapter_dir}", "--texts", str(source),
              "--json", str(out_json), "--svg", str(out_svg), "--method", "exact"])
    report = json.loads(out_json.read_text())
    [tuned] = report["compare"]
    ids = tokenizer.encode_batch(TEXTS[:2])
    assert report["model"]["adapter"] is None and tuned["model"]["adapter"] == ADAPTER
    assert means(tuned) == pytest.approx(means(analyze(model, ids, "exact", adapter=adapter).to_dict()), rel=1e-6)
    assert means(report) == pytest.approx(means(analyze(model, ids, "exact").to_dict()), rel=1e-6)
    assert f"{tiny_model_dir.name} + {ADAPTER}" in out_svg.read_text()
    assert f"+ {ADAPTER}:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["--model-dir", str(tiny_model_dir), "--lora", "nameless", "--texts", str(source), "--json", str(out_json)])
