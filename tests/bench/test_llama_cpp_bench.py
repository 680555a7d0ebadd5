"""bench_serve --llama-cpp without llama.cpp: what llama.cpp's tools printed (captured from the
build `make llama-cpp` makes, on GPT-2 124M) is read right, the commands ask for what the table
compares, and a run that cannot compare is refused before any server starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_serve
from bench.llama_cpp import cmake_commands
from bench.llama_cpp_bench import (
    LlamaCpp,
    LlamaCppError,
    batched_bench_command,
    llama_bench_command,
    parse_batched_bench,
    parse_llama_bench,
)

SAMPLES = Path(__file__).parent / "samples"


def test_llama_bench_json_gives_each_tests_rate():
    stdout = (SAMPLES / "llama-bench.json").read_text()
    rates = parse_llama_bench(stdout)
    assert rates == {(t["n_prompt"], t["n_gen"]): t["avg_ts"] for t in json.loads(stdout)}
    assert set(rates) == {(512, 0), (0, 128)}
    assert rates[512, 0] > rates[0, 128]  # a prompt's tokens run together, a generation's one at a time
    with pytest.raises(LlamaCppError, match="no JSON"):
        parse_llama_bench("error: failed to load model\n")


def test_batched_bench_jsonl_rows():
    stdout = (SAMPLES / "llama-batched-bench.txt").read_text()
    rates = parse_batched_bench(stdout)
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert rates == {row["pl"]: row["speed_tg"] for row in rows} and set(rates) == {1, 4}
    with pytest.raises(LlamaCppError):
        parse_batched_bench("main: n_kv_max = 4608\n")


def test_commands_ask_for_what_the_table_compares():
    bench = llama_bench_command(Path("bin"), Path("m.gguf"), threads=2, prompt_tokens=0, new_tokens=64, repetitions=3)
    assert bench[0] == str(Path("bin") / "llama-bench")
    assert bench[bench.index("-p") + 1] == "0" and bench[bench.index("-n") + 1] == "64"
    assert bench[bench.index("-t") + 1] == "2" and bench[bench.index("-o") + 1] == "json"
    batched = batched_bench_command(Path("bin"), Path("m.gguf"), threads=2, parallel=32, prompt_tokens=16, new_tokens=128)
    assert batched[batched.index("-npl") + 1] == "32"
    # every sequence's prompt and generated tokens fit the cache
    assert int(batched[batched.index("-c") + 1]) >= 32 * (16 + 128)


def test_cmake_builds_the_benchmarks_and_the_quantizer_cpu_only_native():
    configure, build = cmake_commands(Path("src"), Path("out"), jobs=2)
    assert "-DGGML_NATIVE=ON" in configure and "-DCMAKE_BUILD_TYPE=Release" in configure
    assert not any("CUDA" in option or "METAL" in option for option in configure)
    assert build[build.index("--target") + 1 :] == ["llama-bench", "llama-batched-bench", "llama-quantize"]


@pytest.fixture
def replaying_bin(tmp_path):
    """llama.cpp's tools replaced by scripts that print the captured outputs and log their arguments."""
    for tool, sample in (("llama-bench", "llama-bench.json"), ("llama-batched-bench", "llama-batched-bench.txt")):
        script = tmp_path / tool
        script.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\ncat {SAMPLES / sample}\n')
        script.chmod(0o755)
    return tmp_path


def test_each_client_count_meets_its_llama_cpp_figure(replaying_bin):
    llama_cpp = LlamaCpp(replaying_bin, threads=1, new_tokens=128, prompt_tokens=16, repetitions=2)
    bench = parse_llama_bench((SAMPLES / "llama-bench.json").read_text())
    batched = parse_batched_bench((SAMPLES / "llama-batched-bench.txt").read_text())
    assert llama_cpp.clients(Path("m.gguf"), 1) == ("1 client (llama-bench tg128)", bench[0, 128])
    assert llama_cpp.clients(Path("m.gguf"), 4) == ("4 clients (batched-bench S_TG)", batched[4])
    assert llama_cpp.prefill(Path("m.gguf"))[1] == bench[512, 0]
    calls = (replaying_bin / "calls").read_text().splitlines()
    assert "-p 0 -n 128" in calls[0] and "-npl 4" in calls[1] and "-p 512 -n 0" in calls[2]
    # A figure the tool did not print is an error, not a number from another test.
    with pytest.raises(LlamaCppError, match="tg|n_gen"):
        LlamaCpp(replaying_bin, threads=1, new_tokens=64, prompt_tokens=16, repetitions=2).clients(Path("m.gguf"), 1)


@pytest.fixture
def llama_cpp_bin(tmp_path):
    for tool in ("llama-bench", "llama-batched-bench", "llama-quantize"):
        (tmp_path / tool).write_text("")
    return tmp_path


def test_bench_serve_takes_a_llama_cpp_build(llama_cpp_bin):
    args = bench_serve.parse_args(["--llama-cpp", str(llama_cpp_bin), "--quantize", "none", "int8", "int4"])
    assert args.llama_cpp == llama_cpp_bin and args.clients == [1, 32]
    assert bench_serve.parse_args([]).llama_cpp is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dtype", "bfloat16"], "no GGUF type"),
        (["--device", "cuda"], "CPU only"),
    ],
)
def test_bench_serve_refuses_what_it_cannot_compare(llama_cpp_bin, capsys, extra, message):
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--llama-cpp", str(llama_cpp_bin), *extra])
    assert message in capsys.readouterr().err


def test_bench_serve_says_how_to_build_missing_tools(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--llama-cpp", str(tmp_path)])
    assert "make llama-cpp" in capsys.readouterr().err


def test_prefill_prompts_are_exactly_512_tokens_and_all_different(tokenizer):
    texts = bench_serve.long_prompts(tokenizer, 512, 4)
    assert [len(tokenizer.encode(text)) for text in texts] == [512] * 4
    assert len(set(texts)) == 4  # no prompt finds another's keys in the prefix cache
