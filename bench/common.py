"""What every benchmark here shares: loading both implementations, timing, printing."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from model.config import GPT2Config
from model.gpt2 import GPT2
from service.settings import Settings
from tests.processes import STARTUP_TIMEOUT_S, clean_env, free_port
from weights.bpe_source import write_tokenizer_files
from weights.checkpoint import load_model
from weights.prepare import CACHE_DIR
from weights.random_init import init_state, write_model_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_both(model_dir: Path, dtype: torch.dtype):
    """Our model and transformers' GPT2LMHeadModel, from the same folder, in the same dtype."""
    from transformers import GPT2LMHeadModel

    ours = load_model(model_dir, dtype=dtype)
    reference = GPT2LMHeadModel.from_pretrained(model_dir, dtype=dtype).eval()
    # Run exactly the requested number of tokens: stopping at EOS would time different work.
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = ours.config.eos_token_id
    return ours, reference


def interleaved(
    runs: dict[str, Callable[[], object]],
    reps: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds of each run, alternating between them so a change in machine load hits all alike.

    clock=time.process_time counts only the CPU time this process got: on a machine shared with
    other jobs it measures the work done rather than the wait for a core (with one thread).
    """
    for _ in range(warmup):
        for run in runs.values():
            run()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            start = clock()
            run()
            seconds[name].append(clock() - start)
    return seconds


def paired_ratio(reference: list[float], ours: list[float]) -> float:
    """Median over repetitions of reference_time / our_time, each pair measured back to back."""
    return statistics.median(r / o for r, o in zip(reference, ours))


@dataclass
class Row:
    name: str
    reference_tok_s: float | None
    ours_tok_s: float
    ratio: float | None
    note: str = ""


def print_table(rows: list[Row]) -> None:
    print(f"{'benchmark':44s} {'transformers':>13s} {'ours':>10s} {'ratio':>7s}  note")
    for row in rows:
        reference = f"{row.reference_tok_s:9.1f} t/s" if row.reference_tok_s else " " * 13
        ratio = f"{row.ratio:6.2f}x" if row.ratio else " " * 7
        print(f"{row.name:44s} {reference:>13s} {row.ours_tok_s:6.1f} t/s {ratio}  {row.note}")


def describe_machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"torch {torch.__version__}, {cpu}, {torch.get_num_threads()} intra-op threads,"
        f" load average {load:.1f} on {os.cpu_count()} CPUs"
    )


def random_bench_model(args: argparse.Namespace) -> GPT2:
    """A kernel benchmark's model after its --threads and --smoke: GPT-2 124M with random weights,
    prepared; with --smoke a 2-layer 64-wide one, not 124M's 500 MB of random weights."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_layer=2, n_embd=64, n_head=2) if args.smoke else GPT2Config()).eval()
    model.prepare()
    return model


def write_random_model(folder: Path, config: GPT2Config) -> Path:
    """A servable folder: random-init weights of `config` and GPT-2's tokenizer."""
    write_model_dir(folder, config, init_state(config, seed=0))
    write_tokenizer_files(folder, CACHE_DIR)
    return folder


def weight_bytes(model: GPT2) -> int:
    """Bytes one decode step must read: every parameter once (wpe rows aside)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name != "wpe.weight")


def add_server_arguments(parser: argparse.ArgumentParser, model_dir: Path, workloads: tuple[str, ...]) -> None:
    """The options every served benchmark shares: the model, where it runs, which workloads."""
    parser.add_argument("--model-dir", type=Path, default=model_dir)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of each server's engine")
    parser.add_argument("--workloads", nargs="+", choices=workloads, default=list(workloads))


def add_smoke_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, one repetition: the script runs end to end in seconds (the test suite's "
                             "smoke run); what it prints then measures nothing")


def service_flags(args: argparse.Namespace, slots: int, max_new_tokens: int) -> list[str]:
    """The `python -m service` flags every served benchmark's servers share (what its parser's
    add_server_arguments, or bench_serve's own, took)."""
    # The server refuses a --max-new-tokens below its default for requests that name none.
    max_new_tokens = max(max_new_tokens, Settings.model_fields["default_max_new_tokens"].default)
    flags = [
        "--model-dir", str(args.model_dir), "--device", args.device, "--dtype", args.dtype,
        "--max-batch-size", str(slots), "--max-waiting", str(max(64, slots)), "--max-new-tokens", str(max_new_tokens),
    ]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    return flags


class ServiceProcess:
    """`python -m service FLAGS` on a free loopback port. Every benchmark's server starts, waits
    and stops here, subclasses only choose the flags: a subclass that opened its own process would
    also have to redo the log and the stop, and one that forgot half of it crashed at the end of
    a run (bench_prefix, bench_speculative)."""

    def __init__(self, flags: list[str], cwd: Path | None = None, env: dict[str, str] | None = None,
                 module: str = "service") -> None:
        """`cwd`: the checkout whose code `-m service` runs (another worktree); default, this one.
        `env`: variables added to the server's environment; `module`: what runs instead of
        `service` with the same flags (bench/host_standin.py)."""
        self.flags = list(flags)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", module, *self.flags, "--port", str(self.port)]
        # Its log goes to a file: a pipe nobody reads fills after a few hundred requests' access
        # lines, and the server then blocks writing the next.
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(self.command, cwd=cwd, env=clean_env() | (env or {}), stdout=subprocess.DEVNULL,
                                        stderr=self.log)

    def log_tail(self, chars: int = 2000) -> str:
        """The log's last characters. pread, not seek: the server writes through the same file
        offset, and moving it would make the server overwrite its log."""
        if self.log.closed:
            return ""
        size = os.fstat(self.log.fileno()).st_size
        return os.pread(self.log.fileno(), chars, max(0, size - chars)).decode(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited ({self.process.returncode}): {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not start in {timeout:.0f} s: {self.log_tail()}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def __enter__(self) -> "ServiceProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
