"""Property-based fuzzing from the service's own OpenAPI schema (schemathesis) against a live
server: no 5xx, every response matches its documented schema and content type, and the server is
healthy afterwards. The number of cases run is recorded for RELIABILITY.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.results import record
from tests.service.live import live_server

pytestmark = pytest.mark.slow

# Examples per operation and phase; the coverage phase adds its own boundary cases. ~2,000 cases
# in ~15 s on two cores. FUZZ_EXAMPLES=500 for a longer run.
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "30"))
SEED = 20261123  # reproducible in CI; a failure prints the curl command that reproduces it
CHECKS = "not_a_server_error,response_schema_conformance,content_type_conformance"
TIME_LIMIT_S = 300
CHATML = Path(__file__).parents[1] / "service" / "chat_templates" / "chatml.jinja"


def test_schema_driven_fuzzing_finds_no_server_error(tiny_model_dir, tmp_path):
    report = tmp_path / "schemathesis.json"
    # With a chat template, so that /v1/chat/completions renders what the fuzzer sends.
    with live_server(tiny_model_dir, chat_template=str(CHATML)) as server:
        run = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json", "--checks", CHECKS,
             "--max-examples", str(EXAMPLES), "--seed", str(SEED), "--request-timeout", "60",
             "--report", "json", "--report-json-path", str(report), "--no-color"],
            capture_output=True, text=True, timeout=TIME_LIMIT_S,
            cwd=tmp_path,  # schemathesis keeps a .schemathesis cache in its working directory
        )
        outcome = json.loads(report.read_text())
        cases = outcome["test_cases"]
        print(f"schemathesis: {cases['generated']} cases on {outcome['operations']['tested']} operations")
        record("fuzz", {"cases": cases["generated"], "failures": cases["with_failures"], "errored": cases["errored"],
                        "operations": outcome["operations"]["tested"], "checks": CHECKS, "seed": SEED,
                        "seconds": outcome["running_time"]})
        assert run.returncode == 0 and not outcome["failures"] and not outcome["errors"], run.stdout[-6000:]
        assert cases["generated"] > 0 and outcome["operations"]["tested"] == outcome["operations"]["total"]
        assert server.get("/health").status_code == 200
        assert server.metric("gpt2_kv_cache_usage_ratio") == 0.0  # nothing left holding a slot
        assert "Traceback" not in server.log()
