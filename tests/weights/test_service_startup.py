"""`python -m service` as an operator runs it: a bad folder stops it with the loader's message,
a good one serves /health. Real subprocesses, loopback only, bounded waits, always killed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, write_tiny_model
from tests.processes import STARTUP_TIMEOUT_S, clean_env, free_port
from tests.weights.test_bad_checkpoints import BREAKAGES, broken_model, load_error


def service_command(model_dir: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "service", "--model-dir", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--threads", "1"]


BY_NAME = {b.name: b for b in BREAKAGES}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["only-pickled-checkpoint"])  # each start costs seconds
def test_bad_folder_exits_nonzero_with_the_message(tmp_path, name):
    model_dir, _ = broken_model(tmp_path, BY_NAME[name])
    message = load_error(model_dir)
    done = subprocess.run(
        service_command(model_dir, free_port()), cwd=REPO, env=clean_env(),
        capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S,
    )
    assert done.returncode != 0
    assert message in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr  # a message for an operator, not a crash


@pytest.mark.slow
def test_good_folder_serves_health(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny")
    port = free_port()
    server = subprocess.Popen(
        service_command(model_dir, port), cwd=REPO, env=clean_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        status = None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
                break
            except httpx.TransportError:
                time.sleep(0.25)
        assert server.poll() is None, f"server exited early:\n{server.stdout.read()[-2000:]}"
        assert status == 200
    finally:
        server.kill()
        server.wait(timeout=30)
