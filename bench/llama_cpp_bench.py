"""llama.cpp's own benchmarks, run on GGUFs of the model folder our server serves, so that
bench/bench_serve.py --llama-cpp can print the two side by side (ours / llama.cpp).

What each llama.cpp figure is, and ours beside it:
- batch-1 decode: `llama-bench` tg128 (128 tokens generated after an empty prompt), beside one
  streaming client of our server (--new-tokens per request, short prompt);
- prefill: `llama-bench` pp512 (a 512-token prompt in one batch), beside 512 / TTFT of one
  512-token prompt sent to our server (tokenization, HTTP and the first sampled token included;
  the server prefills it in --max-prefill-tokens chunks, as it serves any prompt);
- 32 parallel: `llama-batched-bench` S_TG (generated tokens / generation time of 32 sequences x
  --new-tokens, their prompts already processed), beside 32 streaming clients' aggregate tok/s
  (which also pays for their short prompts).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench.llama_cpp import convert

# Our serving precision → the GGUF type it is compared with.
GGUF_TYPE = {("none", "float32"): "f32", ("none", "float16"): "f16", ("int8", "float32"): "q8_0"}
PREFILL_TOKENS = 512


class LlamaCppError(RuntimeError):
    """A llama.cpp tool failed, or printed nothing we can read."""


@dataclass
class LlamaCppRates:
    gguf_type: str
    decode: float  # tg tok/s, one sequence
    prefill: float  # pp512 tok/s
    batched: dict[int, float]  # parallel sequences → generation tok/s


def llama_bench_command(bin_dir: Path, gguf: Path, threads: int, new_tokens: int, repetitions: int) -> list[str]:
    return [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(PREFILL_TOKENS),
            "-n", str(new_tokens), "-r", str(repetitions), "-o", "json"]


def batched_bench_command(bin_dir: Path, gguf: Path, threads: int, parallel: list[int], prompt_tokens: int,
                          new_tokens: int) -> list[str]:
    # Enough cache cells for every sequence's prompt and generated tokens.
    context = max(parallel) * (prompt_tokens + new_tokens)
    return [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-c", str(context),
            "-b", "2048", "-ub", "512", "-npp", str(prompt_tokens), "-ntg", str(new_tokens),
            "-npl", ",".join(map(str, parallel)), "--output-format", "jsonl"]


def parse_llama_bench(stdout: str, new_tokens: int) -> tuple[float, float]:
    """(decode tok/s of tg<new_tokens>, prefill tok/s of pp512) from `llama-bench -o json`."""
    try:
        tests = json.loads(stdout[stdout.index("["):])
    except ValueError as exc:
        raise LlamaCppError(f"llama-bench printed no JSON list: {stdout[-500:]!r}") from exc
    rates = {(test["n_prompt"], test["n_gen"]): test["avg_ts"] for test in tests}
    try:
        return rates[0, new_tokens], rates[PREFILL_TOKENS, 0]
    except KeyError as exc:
        raise LlamaCppError(f"llama-bench ran {sorted(rates)}, not pp{PREFILL_TOKENS} and tg{new_tokens}") from exc


def parse_batched_bench(stdout: str) -> dict[int, float]:
    """Parallel sequences → generation tok/s (S_TG), from `llama-batched-bench --output-format jsonl`
    (one JSON line per test, then a blank line)."""
    rates = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            rates[row["pl"]] = row["speed_tg"]
    if not rates:
        raise LlamaCppError(f"llama-batched-bench printed no JSON lines: {stdout[-500:]!r}")
    return rates


def run_tool(command: list[str]) -> str:
    print("+", " ".join(command), flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise LlamaCppError(f"{Path(command[0]).name} exited with {result.returncode}: {result.stderr[-2000:]}")
    return result.stdout


def measure(bin_dir: Path, model_dir: Path, gguf_type: str, threads: int, parallel: list[int], prompt_tokens: int,
            new_tokens: int, repetitions: int, gguf_dir: Path) -> LlamaCppRates:
    """llama.cpp's rates on a GGUF of model_dir (converted first when missing)."""
    (gguf,) = convert(model_dir, gguf_dir, (gguf_type,))
    decode, prefill = parse_llama_bench(run_tool(llama_bench_command(bin_dir, gguf, threads, new_tokens, repetitions)),
                                        new_tokens)
    batched = parse_batched_bench(run_tool(batched_bench_command(bin_dir, gguf, threads, parallel, prompt_tokens, new_tokens)))
    return LlamaCppRates(gguf_type, decode, prefill, batched)


def comparison_rows(ours_label: str, served: dict[int, float], prefill: float, theirs: LlamaCppRates) -> list[tuple[str, str, float, float]]:
    """(precision, workload, ours, llama.cpp) for one of our serving precisions; 1 client against
    tg, every other client count against batched-bench at that many sequences."""
    precision = f"{ours_label} / {theirs.gguf_type.upper()}"
    rows = []
    for clients, rate in served.items():
        if clients == 1:
            rows.append((precision, "1 client (llama-bench tg)", rate, theirs.decode))
        elif clients in theirs.batched:
            rows.append((precision, f"{clients} clients (batched-bench S_TG)", rate, theirs.batched[clients]))
    rows.append((precision, f"prefill {PREFILL_TOKENS} (ours: 512/TTFT; pp{PREFILL_TOKENS})", prefill, theirs.prefill))
    return rows


def print_comparison(rows: list[tuple[str, str, float, float]]) -> None:
    print(f"{'ours / llama.cpp':18s} {'workload':44s} {'ours tok/s':>11s} {'llama.cpp tok/s':>16s} {'ratio':>7s}")
    for precision, workload, ours, theirs in rows:
        print(f"{precision:18s} {workload:44s} {ours:11.1f} {theirs:16.1f} {ours / theirs:6.2f}x")
