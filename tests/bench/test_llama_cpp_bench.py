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
    LlamaCppError,
    LlamaCppRates,
    batched_bench_command,
    comparison_rows,
    llama_bench_command,
    parse_batched_bench,
    parse_llama_bench,
)

SAMPLES = Path(__file__).parent / "samples"


def test_llama_bench_json_gives_decode_and_prefill():
    stdout = (SAMPLES / "llama-bench.json").read_text()
    tests = json.loads(stdout)
    decode, prefill = parse_llama_bench(stdout, new_tokens=128)
    assert decode == next(t["avg_ts"] for t in tests if t["n_gen"] == 128)
    assert prefill == next(t["avg_ts"] for t in tests if t["n_prompt"] == 512)
    assert prefill > decode  # a prompt's tokens run together, a generation's one at a time


def test_llama_bench_without_the_asked_test_is_an_error():
    stdout = (SAMPLES / "llama-bench.json").read_text()
    with pytest.raises(LlamaCppError, match="tg64"):
        parse_llama_bench(stdout, new_tokens=64)
    with pytest.raises(LlamaCppError, match="no JSON"):
        parse_llama_bench("error: failed to load model\n", new_tokens=128)


def test_batched_bench_jsonl_rows():
    stdout = (SAMPLES / "llama-batched-bench.txt").read_text()
    rates = parse_batched_bench(stdout)
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert rates == {row["pl"]: row["speed_tg"] for row in rows} and set(rates) == {1, 4}
    with pytest.raises(LlamaCppError):
        parse_batched_bench("main: n_kv_max = 4608\n")


def test_commands_ask_for_what_the_table_compares():
    bench = llama_bench_command(Path("bin"), Path("m.gguf"), threads=2, new_tokens=64, repetitions=3)
    assert bench[0] == str(Path("bin") / "llama-bench")
    assert bench[bench.index("-p") + 1] == "512" and bench[bench.index("-n") + 1] == "64"
    assert bench[bench.index("-t") + 1] == "2" and bench[bench.index("-o") + 1] == "json"
    batched = batched_bench_command(Path("bin"), Path("m.gguf"), threads=2, parallel=[4, 32], prompt_tokens=16, new_tokens=128)
    assert batched[batched.index("-npl") + 1] == "4,32"
    # every sequence's prompt and generated tokens fit the cache
    assert int(batched[batched.index("-c") + 1]) >= 32 * (16 + 128)


def test_cmake_builds_the_two_tools_cpu_only_native():
    configure, build = cmake_commands(Path("src"), Path("out"), jobs=2)
    assert "-DGGML_NATIVE=ON" in configure and "-DCMAKE_BUILD_TYPE=Release" in configure
    assert not any("CUDA" in option or "METAL" in option for option in configure)
    assert build[build.index("--target") + 1 :] == ["llama-bench", "llama-batched-bench"]


def test_each_client_count_meets_its_llama_cpp_figure():
    theirs = LlamaCppRates("q8_0", decode=160.0, prefill=700.0, batched={32: 350.0})
    rows = comparison_rows("int8", {1: 80.0, 32: 700.0, 16: 500.0}, prefill=350.0, theirs=theirs)
    by_workload = {workload: (ours, llama) for _, workload, ours, llama in rows}
    assert by_workload["1 client (llama-bench tg)"] == (80.0, 160.0)
    assert by_workload["32 clients (batched-bench S_TG)"] == (700.0, 350.0)
    assert not any(w.startswith("16 clients") for w in by_workload)  # no llama.cpp figure at 16
    assert [ours_llama for w, ours_llama in by_workload.items() if w.startswith("prefill")] == [(350.0, 700.0)]
    assert {precision for precision, *_ in rows} == {"int8 / Q8_0"}


@pytest.fixture
def llama_cpp_bin(tmp_path):
    for tool in ("llama-bench", "llama-batched-bench"):
        (tmp_path / tool).write_text("")
    return tmp_path


def test_bench_serve_takes_a_llama_cpp_build(llama_cpp_bin):
    args = bench_serve.parse_args(["--llama-cpp", str(llama_cpp_bin), "--quantize", "none", "int8"])
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
