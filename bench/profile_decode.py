"""Where one decode step's time goes: torch.profiler's operator table, per step.

    .venv/bin/python -m bench.profile_decode --threads 1 --batch 1
    .venv/bin/python -m bench.profile_decode --threads 1 --batch 32 --engine
    .venv/bin/python -m bench.profile_decode --threads 1 --batch 1 --unpacked   # PyTorch's kernels

--engine profiles whole engine steps (scheduling, sampling, streaming included) instead of bare
model forwards. Also prints the weight bytes a step reads and the bandwidth that implies.

--against REV profiles the model/, service/ and weights/ of git revision REV beside the working
tree's, in one run: each in its own process, alternating for --rounds rounds (so a change in the
machine's load hits both alike), then the median ms per step of each and both operator tables.

    .venv/bin/python -m bench.profile_decode --threads 1 --batch 1 --engine --against main
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import DTYPES, describe_machine, weight_bytes
from model.kv_cache import KVCache
from model.quantized import QUANTIZE_MODES
from service.inprocess import Engine, EngineConfig
from service.engine.types import GenerationRequest, SamplingParams
from weights.checkpoint import load_model
from weights.tokenizer import GPT2Tokenizer


def model_steps(model, batch: int, context: int):
    cache = KVCache(model.config, batch, context + 64, model.device, model.dtype)
    rows = cache.batch(cache.allocate(batch))
    ids = torch.randint(0, model.config.vocab_size, (batch, context))  # [B, T]
    model(ids, cache=cache, rows=rows)
    token = ids[:, -1:]  # [B, 1]
    position = torch.full((batch, 1), context)  # [B, 1]

    def step():
        model(token, position, cache, rows, kv_length=context + 1)

    return step


def engine_steps(model, tokenizer, batch: int, context: int, steps: int):
    engine = Engine(model, tokenizer, EngineConfig(max_slots=batch, max_len=context + 4 * steps + 8))
    params = SamplingParams(max_new_tokens=4 * steps + 4, ignore_eos=True)
    now = time.monotonic()
    engine.submit(
        [GenerationRequest(f"p{i}", torch.randint(0, 50000, (context,)).tolist(), params, now) for i in range(batch)]
    )
    engine.step()  # the prefill
    return engine.step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("weights/gpt2"))
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--unpacked", action="store_true", help="PyTorch's default kernels")
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--quantize", choices=QUANTIZE_MODES, default="none", help="the engine core's weights (model/quantized.py)")
    parser.add_argument("--rows", type=int, default=15, help="operators shown")
    parser.add_argument("--against", metavar="REV", help="also profile git revision REV's code, side by side")
    parser.add_argument("--rounds", type=int, default=3, help="with --against: alternations of the two")
    args = parser.parse_args()
    if args.against:
        own = ["--against", "--rounds", "--model-dir"]
        compare(args.against, args.rounds, without(sys.argv[1:], own) + ["--model-dir", str(args.model_dir.resolve())])
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model_dir, dtype=DTYPES[args.dtype])  # packed by load_model
    if args.unpacked:
        model.prepare(use_packed=False)
    if args.quantize != "none":
        model.quantize(args.quantize)
    with torch.inference_mode():
        if args.engine:
            step = engine_steps(model, GPT2Tokenizer.from_dir(args.model_dir), args.batch, args.context, args.steps)
        else:
            step = model_steps(model, args.batch, args.context)
        for _ in range(3):
            step()
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        for _ in range(args.steps):
            step()
        cpu = (time.process_time() - cpu_start) / args.steps
        wall = (time.perf_counter() - wall_start) / args.steps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
    print(describe_machine())
    nbytes = weight_bytes(model)
    print(
        f"batch {args.batch}, context {args.context}, {args.dtype}, packed={not args.unpacked},"
        f" engine={args.engine}, quantize={args.quantize}: {wall * 1e3:.1f} ms/step wall, {cpu * 1e3:.1f} ms CPU;"
        f" {args.batch / wall:.0f} tokens/s; weights {nbytes / 1e6:.0f} MB -> {nbytes / cpu / 1e9:.1f} GB/s"
        " per CPU second"
    )
    print(f"operators, totals over {args.steps} steps:")
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    products = sum(event.self_cpu_time_total for event in averages if event.key in PRODUCT_OPS) / args.steps / 1e3
    rest = sum(event.self_cpu_time_total for event in averages) / args.steps / 1e3 - products
    print(f"profiled self CPU per step: products {products:.1f} ms, everything else {rest:.1f} ms")


# The operators that run the matrix products (model/linear.py), whichever kernel serves.
PRODUCT_OPS = {"mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear", "quantized::linear_dynamic",
               "aten::_weight_int4pack_mm_for_cpu"}
REPO = Path(__file__).resolve().parents[1]
STEP_LINE_REST = re.compile(r"products ([\d.]+) ms, everything else ([\d.]+) ms")
STEP_LINE = re.compile(r"([\d.]+) ms/step wall, ([\d.]+) ms CPU")


def revision_tree(revision: str, into: Path) -> Path:
    """model/, service/ and weights/ as they are at `revision`, with this bench/ beside them."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", revision, "model", "service", "weights"],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    shutil.copytree(REPO / "bench", into / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    return into


def without(argv: list[str], options: list[str]) -> list[str]:
    """argv less the given options and their values (`--opt value` or `--opt=value`)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif arg.split("=", 1)[0] not in options:
            kept.append(arg)
    return kept


def compare(revision: str, rounds: int, argv: list[str]) -> None:
    """This script's profile of REV's code and of the working tree's, alternating, each in a process."""
    with tempfile.TemporaryDirectory() as tmp:
        trees = {revision: revision_tree(revision, Path(tmp)), "working tree": REPO}
        outputs: dict[str, str] = {}
        steps: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in trees}
        for _ in range(rounds):
            for name, tree in trees.items():
                env = dict(os.environ, PYTHONPATH=str(tree))
                result = subprocess.run([sys.executable, "-m", "bench.profile_decode", *argv], cwd=tree, env=env,
                                        capture_output=True, text=True, check=True)
                outputs[name] = result.stdout
                wall, cpu = STEP_LINE.search(result.stdout).groups()
                products, rest = STEP_LINE_REST.search(result.stdout).groups()
                steps[name].append((float(wall), float(cpu), float(products), float(rest)))
    for name, output in outputs.items():
        print(f"=== {name} (last round) ===\n{output}")
    print(f"ms per step, median of {rounds} alternating rounds:")
    for name, rounds_seen in steps.items():
        walls, cpus, products, rest = (statistics.median(column) for column in zip(*rounds_seen))
        print(f"  {name:14s} {walls:7.2f} ms wall {cpus:7.2f} ms CPU; profiled: products {products:6.2f} ms,"
              f" everything else {rest:6.2f} ms   (CPU by round: {', '.join(f'{r[1]:.1f}' for r in rounds_seen)})")


if __name__ == "__main__":
    main()
