"""Clients whose pins clash with the test venv's, run unchanged from their own venv (.venv-clients,
`make test` builds it from tests/clients/requirements.txt) as subprocesses against one live server:
guidellm's benchmark (vLLM's serving benchmark) in both request formats, and instructor in its
TOOLS and JSON_SCHEMA modes. Nothing may reach a hub: the clients run with the hubs offline and
GPT-2's tokenizer from the local model folder."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.conftest import DEFAULT_MODEL_DIR, REPO
from tests.processes import clean_env
from tests.service.live import live_server

pytestmark = pytest.mark.slow

CLIENTS_PY = REPO / ".venv-clients" / "bin" / "python"
GUIDELLM = CLIENTS_PY.parent / "guidellm"
INSTRUCTOR_CLIENT = REPO / "tests" / "clients" / "instructor_client.py"
CHATML = Path(__file__).parent / "chat_templates" / "chatml.jinja"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS = 16, 8, 6
CLIENT_TIMEOUT_S = 300  # a bound on each client run, never a measurement


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    if not CLIENTS_PY.exists():
        pytest.skip("no .venv-clients: `make .venv-clients/.installed` (make test does it) installs guidellm and instructor")
    with live_server(tiny_model_dir, chat_template=str(CHATML)) as running:
        yield running


def run_client(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, env={**clean_env(), **OFFLINE}, capture_output=True, text=True,
                          timeout=CLIENT_TIMEOUT_S)
    assert done.returncode == 0, f"{args[:2]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def guidellm_benchmark(url: str, request_format: str, profile: str, out: Path) -> dict:
    """One guidellm run of REQUESTS synthetic requests; its JSON report's only benchmark."""
    run_client([
        str(GUIDELLM), "run",
        "--backend", f"kind=openai_http,target={url},model=gpt2,request_format={request_format}",
        "--profile", profile,
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={DEFAULT_MODEL_DIR}",
        "--output", f"kind=json,path={out}",
        "--disable-console",
    ], cwd=out.parent)
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    return benchmark


@pytest.mark.parametrize(("request_format", "profile"), [
    ("/v1/chat/completions", "kind=synchronous"),
    ("/v1/completions", "kind=concurrent,streams=2"),
])
def test_guidellm_benchmark(server, tmp_path, request_format, profile):
    benchmark = guidellm_benchmark(server.url, request_format, profile, tmp_path / "benchmarks.json")
    # guidellm exits 0 even when every request failed: its report says what happened.
    errors = [r["info"]["error"] for r in benchmark["requests"]["errored"] + benchmark["requests"]["incomplete"]]
    assert benchmark["metrics"]["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                                      "total": REQUESTS}, errors[:3]
    for request in benchmark["requests"]["successful"]:
        body = json.loads(request["request_args"])["body"]
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        # Its token counts come only from the usage the server streams (none: it records None).
        whole = httpx.post(server.url + request_format, json={**body, "stream": False, "stream_options": None},
                           timeout=60).json()
        assert request["input_metrics"]["text_tokens"] == whole["usage"]["prompt_tokens"]
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS  # it sends ignore_eos
    # The usage it asked for, replayed as it sent it: the usage so far in every chunk.
    body = json.loads(benchmark["requests"]["successful"][0]["request_args"])["body"]
    with httpx.stream("POST", server.url + request_format, json=body, timeout=60) as streamed:
        chunks = [json.loads(line[len("data: "):]) for line in streamed.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks and all(chunk.get("usage") for chunk in chunks), chunks
    completion_tokens = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == OUTPUT_TOKENS


@pytest.mark.parametrize(("mode", "sent"), [("TOOLS", ["tool_choice", "tools"]), ("JSON_SCHEMA", ["response_format"])])
def test_instructor(server, tmp_path, mode, sent):
    done = run_client([str(CLIENTS_PY), str(INSTRUCTOR_CLIENT), server.url + "/v1", mode], cwd=tmp_path)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["sent"] == sent  # the mode's own request shape reached the server
    verdict = report["verdict"]
    assert set(verdict) == {"answer", "confidence"} and verdict["answer"] in ("yes", "no")
    assert isinstance(verdict["confidence"], int) and 0 <= verdict["confidence"] <= 9
