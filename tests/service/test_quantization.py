"""`--quantize int8` in the service: the engine core generates from int8 weights, the analysis
routes keep reading the HTTP process's float weights, /info says which is which, and a bad value
or an impossible combination stops start-up with a message."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from model.generate import greedy_generate_uncached
from model.linear import Conv1D, Int8Weight, int8_problem
from service.__main__ import main
from service.app import create_app
from tests.service.conftest import settings_for
from tests.service.test_startup_errors import start
from weights.checkpoint import load_model

needs_int8 = pytest.mark.skipif(
    int8_problem("cpu", torch.float32) is not None, reason=str(int8_problem("cpu", torch.float32))
)
PROMPT = "The quick brown fox"


def test_info_says_float_weights_by_default(client):
    assert client.get("/info").json()["quantization"] == {
        "mode": "none", "generation_weights": "float32", "analysis_weights": "float32", "method": None,
    }


@pytest.fixture(scope="module")
def int8_client(tiny_model_dir):
    with TestClient(create_app(settings_for(tiny_model_dir, quantize="int8"))) as test_client:
        yield test_client


@needs_int8
def test_info_says_generation_is_int8_and_analysis_float(int8_client):
    quantization = int8_client.get("/info").json()["quantization"]
    assert quantization["mode"] == "int8" and quantization["generation_weights"] == "int8"
    assert quantization["analysis_weights"] == "float32" and "FBGEMM" in quantization["method"]


@needs_int8
def test_generation_uses_int8_weights(int8_client, tiny_model_dir, tokenizer):
    response = int8_client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 10, "details": True}})
    assert response.status_code == 200, response.text
    served = [t["id"] for t in response.json()["details"]["tokens"]]
    int8 = load_model(tiny_model_dir)
    int8.quantize("int8")
    prompt = torch.tensor([tokenizer.encode(PROMPT)])
    assert served == greedy_generate_uncached(int8, prompt, 10)[0].tolist()
    # The logprobs the core reports are the int8 model's, not the float one's.
    logprobs = [t["logprob"] for t in response.json()["details"]["tokens"]]
    with torch.no_grad():
        float_first = load_model(tiny_model_dir)(prompt).logits[0, -1].log_softmax(-1)[served[0]]
        int8_first = int8(prompt).logits[0, -1].log_softmax(-1)[served[0]]
    assert logprobs[0] == pytest.approx(float(int8_first), abs=1e-5)
    assert float_first != int8_first


@needs_int8
def test_analysis_reads_the_float_weights(int8_client, tiny_model_dir, tokenizer):
    model = int8_client.app.state.service.model  # the HTTP process's copy
    assert model.quantization == "none"
    assert not any(isinstance(m.packed, Int8Weight) for m in model.modules() if isinstance(m, Conv1D))
    response = int8_client.post("/analyze/logit-lens", json={"text": PROMPT, "top_k": 1})
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
    assert "quantize" in error and "int8" in error, error


@pytest.mark.parametrize("flags, words", [(["--dtype", "bfloat16"], ["float32", "bfloat16"])])
def test_a_combination_int8_cannot_serve_is_one_line(tiny_model_dir, flags, words):
    message = start("--model-dir", str(tiny_model_dir), "--quantize", "int8", *flags)
    assert "--quantize int8" in message
    for word in words:
        assert word in message, message


@needs_int8
def test_metrics_name_the_quantization(int8_client, client):
    for each, mode in ((int8_client, "int8"), (client, "none")):
        info = [line for line in each.get("/metrics").text.splitlines() if line.startswith("gpt2_model_info{")]
        assert len(info) == 1 and f'quantization="{mode}"' in info[0], info
