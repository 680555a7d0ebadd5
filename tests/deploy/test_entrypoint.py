"""The image's entrypoint and health check, run for real on this machine (no Docker needed: they
are a shell script and a Python script, and the image's `python` is this venv's)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model.config import PRESETS, GPT2Config
from tests.deploy.deploy_files import DEPLOY, REPO
from tests.processes import free_port
from weights.prepare import is_prepared, read_origin

ENTRYPOINT = DEPLOY / "docker" / "entrypoint.sh"
HEALTHCHECK = DEPLOY / "docker" / "healthcheck.py"
PREPARING = "preparing the default model"


def container_env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPT2_")}
    # The image's `python` is the one on PATH; here, the venv's.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, "GPT2_OFFLINE": "1", **variables}


def healthcheck(port: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTHCHECK)], env=container_env(GPT2_PORT=str(port)),
                          capture_output=True, text=True)


def test_serves_a_mounted_model_untouched_and_the_healthcheck_follows_it(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "models" / "gpt2"
    shutil.copytree(tiny_model_dir, model_dir)
    files_before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    port = free_port()
    assert healthcheck(port).returncode == 1, "nothing listens yet: the check must fail"

    server = subprocess.Popen(
        ["sh", str(ENTRYPOINT)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=container_env(GPT2_MODEL_DIR=str(model_dir), GPT2_HOST="127.0.0.1", GPT2_PORT=str(port)),
    )
    try:
        # Bounded wait for start-up (not a timing assertion): the check passes once it serves.
        deadline = time.monotonic() + 120
        while healthcheck(port).returncode != 0:
            assert server.poll() is None, f"the server exited: {server.stdout.read()}"
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.5)
        # The shell exec'd the server: the process Docker signals on stop is Python itself.
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[1:3] == [b"-m", b"service"], cmdline
    finally:
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=60)[0]
    # uvicorn shuts down cleanly, then re-raises the signal it caught.
    assert server.returncode in (0, -signal.SIGTERM), output
    assert PREPARING not in output
    # A user's folder (this one has no ORIGIN.json) is served as it is, never re-prepared.
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == files_before


def test_other_commands_run_as_given_without_preparing(tmp_path):
    model_dir = tmp_path / "models" / "gpt2"
    result = subprocess.run(
        ["sh", str(ENTRYPOINT), "python", "-c", "print('ran')"], cwd=REPO, capture_output=True, text=True,
        env=container_env(GPT2_MODEL_DIR=str(model_dir)),
    )
    assert result.returncode == 0 and result.stdout == "ran\n", result.stderr
    assert not model_dir.exists()


@pytest.mark.slow
def test_replicas_starting_on_an_empty_volume_prepare_the_model_once(tmp_path):
    volume = tmp_path / "models"
    model_dir = volume / "gpt2"
    model_dir.mkdir(parents=True)  # an empty folder, as a fresh volume may hold
    # The smallest preset: what is under test is the locking, not the model's size.
    env = container_env(GPT2_MODEL_DIR=str(model_dir), GPT2_PREPARE_ARGS="--source random --preset distilgpt2")
    replicas = [
        subprocess.Popen(["sh", str(ENTRYPOINT), "--prepare-only"], cwd=REPO, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    logs = [replica.communicate(timeout=600)[1] for replica in replicas]
    assert [r.returncode for r in replicas] == [0, 0], logs
    assert sum(PREPARING in log for log in logs) == 1, logs
    assert is_prepared(model_dir)
    assert read_origin(model_dir)["source"] == "random-init"
    # GPT2_PREPARE_ARGS reached weights.prepare, word by word.
    assert GPT2Config.from_json(model_dir / "config.json").n_layer == PRESETS["distilgpt2"].n_layer
    assert sorted(p.name for p in volume.iterdir()) == [".prepare.lock", "gpt2"]
