"""LoRA adapters over HTTP: chosen by OpenAI's `model` and TGI's `adapter_id`, listed by
/v1/models, loaded and unloaded at run time behind the API key (vLLM's admin routes)."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from model.lora_format import CONFIG_FILE, WEIGHTS_FILE
from service.app import create_app
from tests.conftest import error_of
from tests.engine.conftest import hf_generate
from tests.model.test_lora import PEFT_CONFIGS, load_reference_model, peft_adapter
from tests.service.conftest import settings_for

peft = pytest.importorskip("peft")
KEY = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory) -> dict:
    return {name: peft_adapter(tmp_path_factory.mktemp(name), tiny_model_dir, seed=seed, **PEFT_CONFIGS[config])
            for seed, (name, config) in enumerate([("poems", "all-modules"), ("comedies", "rslora"), ("later", "attention-only")])}


@pytest.fixture(scope="module")
def served(tiny_model_dir, adapter_dirs):
    settings = settings_for(tiny_model_dir, api_key="k", lora=[f"{n}={adapter_dirs[n]}" for n in ("poems", "comedies")])
    with TestClient(create_app(settings), headers=KEY) as client:
        yield client


def completion_ids(client, model: str, prompt: list[int], max_tokens: int = 8):
    return client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


@torch.inference_mode()
def test_each_name_serves_its_own_model(served, tiny_model_dir, adapter_dirs, tokenizer):
    models = served.get("/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("gpt2", None), ("poems", "gpt2"), ("comedies", "gpt2")]
    prompt = [464, 2068, 7586, 21831]
    texts = {}
    for name in ("gpt2", "poems", "comedies"):
        response = completion_ids(served, name, prompt)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == name
        texts[name] = response.json()["choices"][0]["text"]
    assert len(set(texts.values())) == 3  # each adapter changes what is written
    # What peft's own model on transformers' GPT-2 writes with the same folder, greedy.
    reference = peft.PeftModel.from_pretrained(load_reference_model(tiny_model_dir), adapter_dirs["poems"]).eval()
    assert texts["poems"] == tokenizer.decode(hf_generate(reference, prompt, 8))
    tgi = served.post("/generate", json={"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 8, "adapter_id": "poems"}})
    openai = served.post("/v1/completions", json={"model": "poems", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0})
    assert tgi.status_code == 200 and tgi.json()["generated_text"] == openai.json()["choices"][0]["text"]


def test_unknown_names_are_refused_naming_what_is_served(served):
    openai = completion_ids(served, "sonnets", [1, 2, 3])
    kind, message = error_of(openai)
    assert openai.status_code == 404 and kind == "model_not_found" and "'sonnets'" in message and "'poems'" in message
    tgi = served.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2, "adapter_id": "sonnets"}})
    # TGI's clients know only TGI's kinds: huggingface_hub raises its ValidationError for this one.
    assert tgi.status_code == 404 and tgi.json()["error_type"] == "validation" and "'sonnets'" in tgi.json()["error"]


def test_adapters_load_and_unload_at_run_time_losing_nothing(served, adapter_dirs, tmp_path):
    refused = served.post("/v1/load_lora_adapter", json={"lora_name": "empty", "lora_path": str(tmp_path)})
    assert refused.status_code == 422 and "adapter_config.json" in error_of(refused)[1]
    taken = served.post("/v1/load_lora_adapter", json={"lora_name": "poems", "lora_path": str(adapter_dirs["later"])})
    assert taken.status_code == 422
    loaded = served.post("/v1/load_lora_adapter", json={"lora_name": "later", "lora_path": str(adapter_dirs["later"])})
    assert loaded.status_code == 200, loaded.text
    assert "later" in [m["id"] for m in served.get("/v1/models").json()["data"]]
    body = {"model": "later", "prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0}
    expected = served.post("/v1/completions", json=body).json()["choices"][0]["text"]
    # Unloaded while a request runs with it: that request finishes as it would have.
    results = {}
    running = threading.Thread(target=lambda: results.update(r=served.post("/v1/completions", json=body)))
    running.start()
    unloaded = served.post("/v1/unload_lora_adapter", json={"lora_name": "later"})
    running.join(60)
    assert unloaded.status_code == 200, unloaded.text
    assert results["r"].status_code in (200, 404)  # 404 only if the unload came first
    if results["r"].status_code == 200:
        assert results["r"].json()["choices"][0]["text"] == expected
    assert completion_ids(served, "later", [1, 2]).status_code == 404
    assert served.post("/v1/unload_lora_adapter", json={"lora_name": "later"}).status_code == 404
    assert "later" not in [m["id"] for m in served.get("/v1/models").json()["data"]]


def test_run_time_changes_need_the_api_key(tiny_model_dir, adapter_dirs):
    with TestClient(create_app(settings_for(tiny_model_dir))) as open_server:
        answer = open_server.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapter_dirs["later"])})
        assert answer.status_code == 403 and "--api-key" in error_of(answer)[1]


def test_a_request_checked_before_its_adapter_was_unloaded_gets_404_not_500(served):
    """The HTTP side checks a name against its list, then tokenizes, then sends: an unload can
    land in between. The core's refusal is then the same 404 the check would have given."""
    assert served.post("/v1/unload_lora_adapter", json={"lora_name": "comedies"}).status_code == 200
    client = served.app.state.service.client
    client.adapters.append("comedies")  # the HTTP side's list as it was when the request was checked
    try:
        answer = completion_ids(served, "comedies", [1, 2, 3])
    finally:
        client.adapters.remove("comedies")
    assert answer.status_code == 404 and "'comedies'" in error_of(answer)[1], answer.text


def test_a_malformed_adapter_folder_is_refused_and_the_server_goes_on(served, adapter_dirs, tmp_path):
    """The configs that once killed the engine core (re.error, TypeError, RecursionError) and a
    NaN tensor: each a 422 naming the problem, the server healthy and generating after all of them."""
    source = adapter_dirs["later"]
    deep = 100_000
    spoiled = {
        "regex": ('"target_modules": "("', ["target_modules", "not a valid regular expression"]),
        "layers": ('"layers_to_transform": "abc"', ["layers_to_transform", '"abc"']),
        "targets": ('"target_modules": 5', ["target_modules", "got 5"]),
        "rank-key": ('"rank_pattern": {"(": 4}', ["rank_pattern", "not a valid regular expression"]),
        "alpha-value": ('"alpha_pattern": {"c_attn": "x"}', ["alpha_pattern", '"x"']),
        "deep": (f'"target_modules": {"[" * deep}{"]" * deep}', ["nested", str(deep + 1)]),
        "nan": (None, ["lora_B.weight", "non-finite"]),
    }
    for name, (option, words) in spoiled.items():
        folder = tmp_path / name
        folder.mkdir()
        for file in source.iterdir():
            (folder / file.name).write_bytes(file.read_bytes())
        config = json.loads((folder / CONFIG_FILE).read_text())
        if option is None:
            tensors = load_file(str(folder / WEIGHTS_FILE))
            tensors[next(k for k in tensors if "lora_B" in k)][0, 0] = float("nan")
            save_file(tensors, str(folder / WEIGHTS_FILE))
        else:
            key = option.split(":")[0].strip('"')
            config.pop(key)
            (folder / CONFIG_FILE).write_text(json.dumps(config)[:-1] + f", {option}}}")
        answer = served.post("/v1/load_lora_adapter", json={"lora_name": f"bad-{name}", "lora_path": str(folder)})
        assert answer.status_code == 422, (name, answer.status_code, answer.text)
        assert all(word in error_of(answer)[1] for word in words), (name, answer.text)
        assert served.get("/health").status_code == 200
    assert not any(m["id"].startswith("bad-") for m in served.get("/v1/models").json()["data"])
    generated = served.post("/generate", json={"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 4}})
    assert generated.status_code == 200 and generated.json()["generated_text"], generated.text
