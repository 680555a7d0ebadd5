"""bench/gpu_check.py in its smoke mode (CPU, tiny model): every part runs and reports, so the
GPU check cannot rot between runs on a GPU; a part past its limit is reported and killed with
everything it started, and the parts after it still run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from bench import gpu_check
from tests.conftest import REPO
from tests.processes import _processes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "report.json").read_text()), (out / "REPORT.md").read_text()


def test_every_part_runs_and_reports(smoke_report):
    report, markdown = smoke_report
    parts = {row["part"]: row for row in report["parts"]}
    assert list(parts) == [p.name for p in gpu_check.PARTS]
    for name, row in parts.items():
        assert row["status"] == "ok", (name, row.get("log_tail"))
        assert f"## {name}" in markdown
    lane = parts["lane"]["result"]
    assert lane["passed"] > 0 and lane["failed"] == 0 and lane["exit_code"] == 0
    # Every served row has its anchor at the same batch size, so its ratio is filled in.
    anchors = {row["batch"] for row in parts["anchor"]["result"]["rows"]}
    served = parts["serve"]["result"]["rows"]
    counts, processes = report["config"]["clients"], report["config"]["client_processes"]
    # The client counts from one process, then those above 1 again spread over processes.
    assert [(row["clients"], row.get("client_processes", 1)) for row in served] == \
        [(c, 1) for c in counts] + [(c, processes) for c in counts if c > 1]
    assert processes > 1 and anchors >= {r["clients"] for r in served}
    assert all(row["tokens_per_s"] > 0 and row["tokens"] == row["clients"] * report["config"]["new_tokens"] for row in served)
    interval = parts["stream-interval"]["result"]
    assert interval["stream_interval"] == gpu_check.STREAM_INTERVAL and parts["serve"]["result"]["stream_interval"] == 1
    assert [(row["clients"], row.get("client_processes", 1)) for row in interval["rows"]] == \
        [(c, 1) for c in counts[-2:]] + [(c, processes) for c in counts[-2:] if c > 1]
    assert f"--stream-interval {gpu_check.STREAM_INTERVAL}" in markdown
    assert [row["api_servers"] for row in parts["api-servers"]["result"]["rows"]] == report["config"]["api_servers"]
    for row in parts["api-servers"]["result"]["rows"]:
        assert row["http_idle_cpu_percent"] < 50 and (row["gpu_processes"] is None) == (row["http_processes_on_gpu"] is None)
    assert {row["mode"] for row in parts["quantize"]["result"]["rows"]} == {"int8", "int4"}
    assert all(row["outcome"] in ("served", "refused") for row in parts["quantize"]["result"]["rows"])
    assert "served / anchor" in markdown
    chunks = parts["prefill-chunks"]["result"]
    assert chunks["max_prefill_tokens"] == gpu_check.PREFILL_CHUNK and f"--max-prefill-tokens {gpu_check.PREFILL_CHUNK}" in markdown
    assert [row["clients"] for row in chunks["rows"]][:2] == counts[-2:]
    mix = parts["grammar-mix"]["result"]
    assert [row["load"] for row in mix["rows"]] == ["free", "mixed", "mixed", "free"]
    # Every request ran all its tokens, the constrained ones under their grammar's mask included.
    assert all(row["tokens"] == mix["clients"] * report["config"]["new_tokens"] for row in mix["rows"])
    assert mix["mixed_over_free"] > 0 and "Mixed / free tok/s" in markdown


def test_pytest_summary_reads_counts_and_failures():
    output = "\n".join([
        "....F.E", "FAILED tests/a.py::test_x[cuda] - AssertionError: 1 != 2", "ERROR tests/b.py::test_y - boom",
        # a log record pytest captured and printed with a failure: not a test of its own
        "ERROR    service.engine.core:core.py:205 engine step failed",
        "1 failed, 409 passed, 3 skipped, 1 error in 82.10s",
    ])
    assert gpu_check.pytest_summary(output) == {
        "passed": 409, "failed": 1, "errors": 1, "skipped": 3,
        "failures": ["FAILED tests/a.py::test_x[cuda]", "ERROR tests/b.py::test_y"],
    }


def test_a_part_past_its_limit_is_killed_with_what_it_started(tmp_path):
    """The serve part starts a server (and its engine core); a limit far below its start-up ends
    the part as a timeout, and none of its processes outlive it."""
    cfg = gpu_check.Config(gpu_check.smoke_model(tmp_path), "cpu", "float32", tmp_path, True, [1], 2, [1], 16)
    before = {pid for pid, _, _ in _processes()}
    row = gpu_check.run_part(gpu_check.PARTS[2], cfg, limit_s=4.0)
    assert row["status"] == "timeout" and row["part"] == "serve"
    time.sleep(0.5)
    started = [command for pid, _, command in _processes() if pid not in before and b"service" in command]
    assert started == [], started
    # A part that crashes is reported as such, with the end of its log.
    broken = replace(cfg, model_dir=tmp_path / "missing")
    crashed = gpu_check.run_part(gpu_check.PARTS[1], broken, limit_s=120)
    assert crashed["status"] == "crashed" and "missing" in crashed["log_tail"]
