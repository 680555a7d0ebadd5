"""python -m tests.reliability.report: run the reliability tests (the ones CI runs) and write
RELIABILITY.md from what they measured.

    python -m tests.reliability.report              # run, then write the table (make reliability)
    python -m tests.reliability.report --render     # only write it, from the last run's results
    RELIABILITY_SOAK=1 python -m tests.reliability.report   # the soak sizes
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import time

import pytest

from tests.conftest import REPO
from tests.reliability.results import RESULTS_DIR, load_all, record

TESTS = ["tests/reliability", "tests/service/test_hostile_input.py", "tests/service/test_startup_errors.py"]
OUT = REPO / "RELIABILITY.md"


class Outcomes:
    """A pytest plugin that keeps each test's outcome for the table."""

    def __init__(self) -> None:
        self.tests: list[dict] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.tests.append({"test": report.nodeid, "outcome": report.outcome, "seconds": round(report.duration, 2)})


def run() -> int:
    shutil.rmtree(RESULTS_DIR, ignore_errors=True)
    outcomes = Outcomes()
    started = time.monotonic()
    code = pytest.main(["-q", "-p", "no:cacheprovider", *TESTS], plugins=[outcomes])
    record("checks", {"tests": outcomes.tests, "seconds": time.monotonic() - started, "exit_code": int(code),
                      "machine": f"{platform.machine()}, {platform.system()}, Python {platform.python_version()}"})
    return int(code)


def fmt_s(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f} s"


def load_row(name: str, r: dict) -> str:
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))
    verdicts = ", ".join(f"{k}: {v}" for k, v in sorted(r["verdicts"].items()))
    memory = f"{r['rss_before_mb']:.0f} → {r['rss_after_mb']:.0f} MB" if "rss_before_mb" in r else "–"
    held = "yes" if r["verdicts"].get("lost", 0) == 0 and r["verdicts"].get("malformed", 0) == 0 else "**no**"
    return (f"| {name} | {r['requests']} | {r['concurrency']} | {statuses} | {verdicts} | {fmt_s(r['p50_s'])} / "
            f"{fmt_s(r['p99_s'])} | {memory} | {r['faults']} | {held} |")


def memory_section(m: dict) -> list[str]:
    """The soak's RSS curve as the median of each tenth of its samples (one sample may catch a
    long prompt's activations alive)."""
    values = [mb for _, mb in m["rss_mb"]]
    tenth = max(1, len(values) // 10)
    medians = [statistics.median(values[i:i + tenth]) for i in range(0, len(values) - tenth + 1, tenth)]
    return ["## Memory under a long mixed load", "",
            f"{m['clients']} clients of mixed traffic (plain, `typical_p`, a JSON grammar, log-probs with alternatives, "
            f"OpenAI echo, streams left after a few tokens; prompts up to ~700 tokens) for {m['seconds'] / 60:.0f} min "
            f"against the default server (`--threads {m['threads']}`) on {m['cpu']}: {m['requests']} requests, "
            f"{m['errors']} errors. The engine core's RSS, median of each tenth of the run (MB): "
            f"{' → '.join(f'{v:.0f}' for v in medians)} (highest sample {max(values):.0f}); over the last half "
            f"{100 * m['growth_over_last_half']:+.1f}% (must stay under 2%: tests/reliability/test_memory_soak.py)."]


def render(results: dict[str, dict]) -> str:
    lines = ["# Reliability", "",
             "What was tried against a live `python -m service` on loopback, and what held. Written by",
             "`python -m tests.reliability.report` (`make reliability`) from the tests CI runs",
             "(tests/reliability, tests/service/test_hostile_input.py); do not edit by hand.", ""]
    checks = results.get("checks")
    if checks:
        lines += [f"Run: {checks['machine']}, {checks['seconds']:.0f} s, pytest exit code {checks['exit_code']}.", ""]
    lines += ["## Load and faults", "",
              "Verdicts: *complete* (a whole answer, streams to their last event), *error_shape* (a JSON",
              "`{error, error_type}`), *error_event* (a stream already answered 200 ended by such an error",
              "event), *left* (the client left on purpose), *refused* (no connection: the server had exited",
              "after SIGTERM), *lost* / *malformed* (must be 0). p50/p99: complete answers.", "",
              "| run | requests | concurrency | statuses | verdicts | p50 / p99 | server memory (RSS) | faults | held |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, title in (("load", "mixed load"), ("sigterm", "SIGTERM mid-load"),
                        ("killed_core", "engine core killed mid-load"), ("load_soak", "soak")):
        if name in results:
            lines.append(load_row(title, results[name]))
    chaos_runs = [(name, results[name]) for name in ("chaos", "chaos_soak") if name in results]
    if chaos_runs:
        lines += ["", "## Failure isolation", "",
                  "The promise: a request whose own rows fail (logits that are not finite, a grammar llguidance",
                  "cannot follow, an adapter that misbehaves, a beam search that raises) ends alone with its own",
                  "error (422 / 424, never a 5xx); a malformed adapter folder or any message the engine core cannot",
                  "handle is answered as that message's error; every other request goes on with the tokens it",
                  "gets alone. Tested (tests/reliability/test_chaos.py) by sending malformed and NaN adapters,",
                  "requests whose logits are made non-finite mid-generation in the engine core, failing grammars",
                  "and an adapter unloaded while idle, while greedy streams run; each stream must get its solo",
                  "tokens, the engine core keep its pid, /health answer 200 throughout. Gaps: between a plain",
                  "stream's tokens, the same streams together without the chaos, then during it (same run).", "",
                  "| model | plain streams (runs) | hostile requests | statuses they got | /health checks | gap p50 / p99 plain load | gap p50 / p99 during chaos | held |",
                  "|---|---|---|---|---|---|---|---|"]
        for _, c in chaos_runs:
            lines.append(f"| {c['model']} | {c['streams']} ({c['plain_runs']}) | {c['hostile_requests']} | "
                         f"{', '.join(map(str, c['statuses']))} | {c['health_checks']}, all 200 | "
                         f"{c['gap_p50_alone_ms']:.1f} / {c['gap_p99_alone_ms']:.1f} ms | "
                         f"{c['gap_p50_during_ms']:.1f} / {c['gap_p99_during_ms']:.1f} ms | yes |")
    if "memory_soak" in results:
        lines += ["", *memory_section(results["memory_soak"])]
    if "fuzz" in results:
        f = results["fuzz"]
        lines += ["", "## Fuzzing", "",
                  f"schemathesis from the service's own OpenAPI schema: **{f['cases']} cases** on {f['operations']} "
                  f"operations in {f['seconds']:.0f} s (seed {f['seed']}), checks `{f['checks']}`: "
                  f"{f['failures']} failing, {f['errored']} errored; /health 200 and no KV slot held afterwards."]
    if "event_loop" in results:
        e = results["event_loop"]
        lines += ["", "## Event loop", "",
                  f"A token stream while {e['heavy_calls']} ~1 MB requests (/tokenize, /generate) ran for "
                  f"{e['heavy_s']:.1f} s: median gap between tokens before {e['baseline_gap_s'] * 1000:.1f} ms, "
                  f"longest gap during {e['worst_gap_s'] * 1000:.0f} ms ({e['tokens_during']} tokens arrived meanwhile)."]
    if checks:
        lines += ["", "## Hostile inputs and connection faults", "", "| check | outcome | time |", "|---|---|---|"]
        for test in checks["tests"]:
            lines.append(f"| `{test['test']}` | {test['outcome']} | {test['seconds']:.2f} s |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.reliability.report", description=__doc__.splitlines()[0])
    parser.add_argument("--render", action="store_true", help="only write RELIABILITY.md from the last results")
    args = parser.parse_args(argv)
    code = 0 if args.render else run()
    results = load_all()
    if not results:
        sys.exit(f"no results in {RESULTS_DIR}: run without --render first")
    OUT.write_text(render(results))
    print(f"wrote {OUT} from {len(results)} result files in {RESULTS_DIR}")
    print(json.dumps({k: v for k, v in results.items() if k != "checks"}, indent=1)[:2000])
    sys.exit(code)


if __name__ == "__main__":
    main()
