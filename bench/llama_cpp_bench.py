"""llama.cpp's own benchmarks, run on GGUFs of the model folder our server serves, so that
bench/bench_serve.py --llama-cpp can print the two side by side (ours / llama.cpp).

Each llama.cpp figure runs right after the figure of ours it is set beside (same client count,
same precision), so a change in the machine's load hits both alike. What each is:
- batch-1 decode: `llama-bench` tg<N> (N = --new-tokens generated after an empty prompt), beside
  one streaming client of our server (N new tokens per request, short prompt);
- prefill: `llama-bench` pp512 (a 512-token prompt in one batch), beside 512 / TTFT of one
  512-token prompt sent to our server (tokenization, HTTP and the first sampled token included;
  the server prefills it in --max-prefill-tokens chunks, as it serves any prompt);
- C parallel: `llama-batched-bench` S_TG (generated tokens / generation time of C sequences x N,
  their prompts, as long as our clients' on average, already processed), beside C streaming
  clients' aggregate tok/s (which also pays for their short prompts).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Our serving precision → the GGUF type it is compared with.
GGUF_TYPE = {("none", "float32"): "f32", ("none", "float16"): "f16", ("int8", "float32"): "q8_0", ("int4", "float32"): "q4_0"}
PREFILL_TOKENS = 512


class LlamaCppError(RuntimeError):
    """A llama.cpp tool failed, or printed nothing we can read."""


def llama_bench_command(bin_dir: Path, gguf: Path, threads: int, prompt_tokens: int, new_tokens: int,
                        repetitions: int) -> list[str]:
    """One llama-bench test: pp<prompt_tokens> (with new_tokens 0) or tg<new_tokens> (prompt 0)."""
    return [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(prompt_tokens),
            "-n", str(new_tokens), "-r", str(repetitions), "-o", "json"]


def batched_bench_command(bin_dir: Path, gguf: Path, threads: int, parallel: int, prompt_tokens: int,
                          new_tokens: int) -> list[str]:
    # Enough cache cells for every sequence's prompt and generated tokens.
    context = parallel * (prompt_tokens + new_tokens)
    return [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-c", str(context),
            "-b", "2048", "-ub", "512", "-npp", str(prompt_tokens), "-ntg", str(new_tokens),
            "-npl", str(parallel), "--output-format", "jsonl"]


def parse_llama_bench(stdout: str) -> dict[tuple[int, int], float]:
    """(n_prompt, n_gen) → mean tok/s of each test, from `llama-bench -o json`."""
    try:
        tests = json.loads(stdout[stdout.index("["):])
    except ValueError as exc:
        raise LlamaCppError(f"llama-bench printed no JSON list: {stdout[-500:]!r}") from exc
    return {(test["n_prompt"], test["n_gen"]): test["avg_ts"] for test in tests}


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


@dataclass
class LlamaCpp:
    """llama.cpp's tools, run the way bench_serve's figures are compared."""

    bin_dir: Path
    threads: int
    new_tokens: int
    prompt_tokens: int  # of each batched-bench sequence: our clients' mean prompt
    repetitions: int

    def llama_bench(self, gguf: Path, prompt_tokens: int, new_tokens: int) -> float:
        command = llama_bench_command(self.bin_dir, gguf, self.threads, prompt_tokens, new_tokens, self.repetitions)
        rates = parse_llama_bench(run_tool(command))
        if (prompt_tokens, new_tokens) not in rates:
            raise LlamaCppError(f"llama-bench ran {sorted(rates)}, not (n_prompt, n_gen) = {(prompt_tokens, new_tokens)}")
        return rates[prompt_tokens, new_tokens]

    def clients(self, gguf: Path, clients: int) -> tuple[str, float]:
        """What C streaming clients are set beside: (the figure's name, tok/s)."""
        if clients == 1:
            return f"1 client (llama-bench tg{self.new_tokens})", self.llama_bench(gguf, 0, self.new_tokens)
        command = batched_bench_command(self.bin_dir, gguf, self.threads, clients, self.prompt_tokens, self.new_tokens)
        return f"{clients} clients (batched-bench S_TG)", parse_batched_bench(run_tool(command))[clients]

    def prefill(self, gguf: Path) -> tuple[str, float]:
        return f"prefill {PREFILL_TOKENS} (ours: {PREFILL_TOKENS}/TTFT; pp{PREFILL_TOKENS})", self.llama_bench(gguf, PREFILL_TOKENS, 0)


def print_comparison(rows: list[tuple[str, str, float, float]]) -> None:
    """rows: (precision, workload, ours tok/s, llama.cpp tok/s)."""
    print(f"{'ours / llama.cpp':18s} {'workload':44s} {'ours tok/s':>11s} {'llama.cpp tok/s':>16s} {'ratio':>7s}")
    for precision, workload, ours, theirs in rows:
        print(f"{precision:18s} {workload:44s} {ours:11.1f} {theirs:16.1f} {ours / theirs:6.2f}x")
