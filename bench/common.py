"""What every benchmark here shares: loading both implementations, timing, printing."""

from __future__ import annotations

import argparse

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from model.gpt2 import GPT2
from weights.checkpoint import load_model

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
