"""HTTP processes hold no model: /analyze goes to the one analysis process
(service/analysis/process.py), and its death is a 503 at once, never a hang.

What an HTTP process holds is looked at in a fresh interpreter: this one holds the tests' models.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from fastapi.testclient import TestClient

from service.analysis.protocol import Lens, analysis_address
from service.analysis.remote import AnalysisClient, AnalysisUnavailable
from service.app import create_app
from tests.conftest import REPO
from tests.processes import STARTUP_TIMEOUT_S, clean_env, free_port
from tests.service.conftest import settings_for
from weights.checkpoint import load_model

# In a fresh interpreter: build the app (with `device`), answer what needs no engine, then report
# what the process holds. Every CUDA initialisation goes through torch.cuda._lazy_init (tensors on
# a CUDA device call it from C++ too), so counting its calls catches any.
HTTP_PROCESS = """
import gc, json, sys, torch
calls = []
real_init = torch.cuda._lazy_init
torch.cuda._lazy_init = lambda: calls.append(1) or real_init()
from fastapi.testclient import TestClient
from service.app import create_app
from service.settings import Settings

model_dir, device, lifespan = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
app = create_app(Settings(model_dir=model_dir, device=device, threads=1, max_batch_size=2))
client = TestClient(app)
if lifespan:
    client.__enter__()
statuses = {
    "info": client.get("/info").status_code, "metrics": client.get("/metrics").status_code,
    "tokenize": client.post("/tokenize", json={"inputs": "Hello there"}).status_code,
    "bad_layers": client.post("/analyze/attention", json={"text": "x", "layers": [99]}).status_code,
}
if lifespan:
    statuses["lens"] = client.post("/analyze/logit-lens", json={"text": "Hello there", "top_k": 2}).status_code
    statuses["generate"] = client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).status_code
gc.collect()
objects = gc.get_objects()
report = {
    "statuses": statuses, "info": client.get("/info").json(),
    "cuda_initialized": torch.cuda.is_initialized(), "cuda_init_calls": len(calls),
    "modules": sorted({type(o).__name__ for o in objects if isinstance(o, torch.nn.Module)}),
    "tensor_elements": sum(o.numel() for o in objects if isinstance(o, torch.Tensor) and o.device.type != "meta"),
    "analysis_pid": app.state.analysis.pid,
}
if lifespan:
    client.__exit__(None, None, None)
print("REPORT " + json.dumps(report))
"""


def http_process(model_dir, device: str, lifespan: bool) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", HTTP_PROCESS, str(model_dir), device, "1" if lifespan else "0"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    return json.loads(line.removeprefix("REPORT "))


def test_an_http_process_built_for_cuda_never_initialises_it(tiny_model_dir):
    # This machine has no CUDA: loading anything onto it would raise, and _lazy_init would count.
    report = http_process(tiny_model_dir, "cuda", lifespan=False)
    assert report["statuses"] == {"info": 200, "metrics": 200, "tokenize": 200, "bad_layers": 422}
    assert report["cuda_initialized"] is False and report["cuda_init_calls"] == 0
    assert report["modules"] == [] and report["tensor_elements"] == 0
    info = report["info"]
    assert info["model_device_type"] == "cuda" and info["model_dtype"] == "float32"
    assert info["config"]["parameters"] == sum(p.numel() for p in load_model(tiny_model_dir).parameters())


def test_a_serving_http_process_holds_no_parameters(tiny_model_dir):
    report = http_process(tiny_model_dir, "cpu", lifespan=True)
    assert report["statuses"] == {
        "info": 200, "metrics": 200, "tokenize": 200, "bad_layers": 422, "lens": 200, "generate": 200,
    }
    # The tiny model alone has 3.3 M parameters; what is left is the tokenizer's and metrics' few.
    assert report["modules"] == [] and report["tensor_elements"] < 10_000, report
    assert report["analysis_pid"] not in (None, os.getpid())


def test_a_dead_analysis_process_is_a_503_saying_so_and_generation_goes_on(tiny_model_dir):
    with TestClient(create_app(settings_for(tiny_model_dir))) as client:
        body = {"text": "Still here?", "top_k": 1}
        assert client.post("/analyze/logit-lens", json=body).status_code == 200
        os.kill(client.app.state.analysis.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (response := client.post("/analyze/logit-lens", json=body)).status_code == 200:
            assert time.monotonic() < deadline, "still answered after the analysis process was killed"
            time.sleep(0.05)
        assert response.status_code == 503, response.text
        assert response.json()["error_type"] == "unavailable" and "analysis process has stopped" in response.json()["error"]
        assert client.get("/health").status_code == 200
        generated = client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
        assert generated.status_code == 200


# Answers Hello, never anything else: an analysis that never ends, until the process is killed.
SILENT_ANALYST = """
import os, sys, zmq
from service.analysis.protocol import Ready, Reply, encoder, requests
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind(sys.argv[1])
print("bound", flush=True)
while True:
    identity, payload = sock.recv_multipart()
    request = requests.decode(payload)
    if request.id == 0:
        sock.send_multipart([identity, encoder.encode(Reply(0, Ready(os.getpid())))])
"""


def test_a_call_waiting_when_the_analysis_process_dies_fails_at_once(tmp_path):
    address = analysis_address(tmp_path)
    stub = subprocess.Popen([sys.executable, "-c", SILENT_ANALYST, address], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert stub.stdout.readline().strip() == "bound"

        async def scenario() -> float:
            client = AnalysisClient(address, supervisor_pid=os.getpid())
            await client.start(timeout=30)
            assert client.pid == stub.pid
            waiting = asyncio.ensure_future(client.call(Lens([1, 2], 1)))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            killed = time.monotonic()
            stub.kill()
            with pytest.raises(AnalysisUnavailable, match="analysis process has stopped"):
                await asyncio.wait_for(waiting, 10)
            took = time.monotonic() - killed
            with pytest.raises(AnalysisUnavailable):
                await client.call(Lens([1], 1))
            await client.stop()
            return took

        assert asyncio.run(scenario()) < 5
    finally:
        stub.kill()
        stub.wait()


def test_an_analysis_process_that_cannot_load_fails_start_up_with_its_reason(tiny_model_dir, tmp_path):
    from service.analysis.startup import process_config

    async def scenario() -> str:
        client = AnalysisClient.spawning(process_config(settings_for(tmp_path / "nowhere")))
        with pytest.raises(RuntimeError) as failed:
            await client.start(timeout=120)
        return str(failed.value)

    assert "nowhere" in asyncio.run(scenario())


@pytest.mark.slow
def test_a_bad_checkpoint_stops_api_servers_in_one_line(tmp_path):
    """NaN values: only a process that reads the tensors sees them (here, the analysis process)."""
    from tests.weights.test_bad_checkpoints import BREAKAGES, broken_model, load_error

    [nan] = [b for b in BREAKAGES if b.name == "nan-values"]
    model_dir, _ = broken_model(tmp_path, nan)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "service", "--model-dir", str(model_dir), "--api-servers", "2", "--threads", "1",
         "--port", str(free_port())],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    # The last line, for an operator (the engine core, loading the same tensors beside it, logs
    # its own failure above, as it did before the analysis process).
    assert last == f"cannot start: {load_error(model_dir)}", done.stderr[-3000:]
    assert time.monotonic() - started < STARTUP_TIMEOUT_S / 2  # the core was not waited for
