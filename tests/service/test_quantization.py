"""`--quantize int8|int4` in the service: the engine core generates from quantized weights, the
analysis routes keep reading the HTTP process's float weights, /info says which is which, and a bad
value or an impossible combination stops start-up with a message."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from model.generate import greedy_generate_uncached
from model.quantized import QUANTIZE_METHODS
from service.__main__ import main
from service.app import create_app
from tests.conftest import TINY, write_tiny_model
from tests.service.conftest import settings_for
from tests.service.test_startup_errors import start
from weights.checkpoint import load_model

PROMPT = "The quick brown fox"


def test_info_says_float_weights_by_default(client):
    assert client.get("/info").json()["quantization"] == {
        "mode": "none", "generation_weights": "float32", "analysis_weights": "float32", "method": None,
    }


@pytest.fixture(scope="module")
def quantized_client(tiny_model_dir, quantize_mode):
    with TestClient(create_app(settings_for(tiny_model_dir, quantize=quantize_mode))) as test_client:
        yield test_client


def test_info_says_which_weights_generation_and_analysis_read(quantized_client, quantize_mode):
    assert quantized_client.get("/info").json()["quantization"] == {
        "mode": quantize_mode, "generation_weights": quantize_mode, "analysis_weights": "float32",
        "method": QUANTIZE_METHODS[quantize_mode],
    }


def test_generation_uses_the_quantized_weights(quantized_client, quantize_mode, tiny_model_dir, tokenizer):
    response = quantized_client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 10, "details": True}})
    assert response.status_code == 200, response.text
    served = [t["id"] for t in response.json()["details"]["tokens"]]
    quantized = load_model(tiny_model_dir)
    quantized.quantize(quantize_mode)
    prompt = torch.tensor([tokenizer.encode(PROMPT)])
    assert served == greedy_generate_uncached(quantized, prompt, 10)[0].tolist()
    # The logprobs the core reports are the quantized model's, not the float one's.
    logprobs = [t["logprob"] for t in response.json()["details"]["tokens"]]
    with torch.no_grad():
        float_first = load_model(tiny_model_dir)(prompt).logits[0, -1].log_softmax(-1)[served[0]]
        quantized_first = quantized(prompt).logits[0, -1].log_softmax(-1)[served[0]]
    assert logprobs[0] == pytest.approx(float(quantized_first), abs=1e-5)
    assert float_first != quantized_first


def test_analysis_reads_the_float_weights(quantized_client, tiny_model_dir, tokenizer):
    # The analysis process's copy: the float model's own log-probabilities, not the core's.
    response = quantized_client.post("/analyze/logit-lens", json={"text": PROMPT, "top_k": 1})
    assert response.status_code == 200, response.text
    last = response.json()["layers"][-1]["top"]  # the model's own output, per position
    with torch.no_grad():
        logprobs = load_model(tiny_model_dir)(torch.tensor([tokenizer.encode(PROMPT)])).logits[0].log_softmax(-1)
    assert [top[0]["logprob"] for top in last] == pytest.approx(logprobs.max(-1).values.tolist(), abs=1e-5)


def test_an_unknown_mode_is_refused_naming_the_setting(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--model-dir", str(tiny_model_dir), "--quantize", "int3"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "quantize" in error and "int8" in error and "int4" in error, error


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_combination_quantized_weights_cannot_serve_is_one_line(tiny_model_dir, quantize):
    message = start("--model-dir", str(tiny_model_dir), "--quantize", quantize, "--dtype", "bfloat16")
    assert f"--quantize {quantize}" in message
    for word in ("float32", "bfloat16"):
        assert word in message, message


def test_a_model_int4_cannot_group_is_one_line(tmp_path):
    model_dir = write_tiny_model(tmp_path / "narrow", TINY.with_(n_embd=48, n_head=4))
    message = start("--model-dir", str(model_dir), "--quantize", "int4")
    assert "--quantize int4" in message and "48" in message and "64" in message, message


def test_metrics_name_the_quantization(quantized_client, quantize_mode, client):
    for each, label in ((quantized_client, quantize_mode), (client, "none")):
        info = [line for line in each.get("/metrics").text.splitlines() if line.startswith("gpt2_model_info{")]
        assert len(info) == 1 and f'quantization="{label}"' in info[0], info
