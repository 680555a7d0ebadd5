"""The engine core alone, in this process, with the device's work taken out: its host time per
row-step with N requests always running (bench/bench_host.py --core-only runs it per checkout).

    python -m bench.host_core --running 256 [--steps 400] [--overlap] [--profile 25]

The core is the product's EngineCore on a tiny model, with bench/host_standin.py's stand-ins for
the forwards and the draw (no device sleep here: nothing paces the steps but the host). Requests of
64 to 191 new tokens, greedy, prompts of 5 to 44 tokens with varied first tokens, are replaced as
they end, so every step admits and finishes some (the churn of a loaded server: admission,
packing moves, prefix-cache lookups). Printed as one JSON line: CPU time (process_time) per
row-step, per step, rows per step, and (over as many steps again, untimed) the share of the steps
that read their sampled rows in slot order, with no gathers (StepRows.in_slot_order; null in a
checkout without it). No HTTP, no IPC: bench_host.py's server measures those.
`--profile N`: also cProfile's N most expensive functions by their own time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

os.environ["STANDIN_DEVICE_MS"] = "0"  # read by the stand-in at import

import torch

# Run by bench_host.py, this file and this checkout's stand-in are copied to a folder of their own
# and run in each checkout compared (the same stand-in for all); the checkout's code is what they
# import. Run as `python -m bench.host_core`, the stand-in is this checkout's.
try:
    import gpt2_host_standin as standin
except ModuleNotFoundError:
    import bench.host_standin as standin
try:
    import service.engine.step_sampler as engine_sampler
except ModuleNotFoundError:  # a checkout from before the sampling stage left core.py
    import service.engine.core as engine_sampler
from service.engine.core import EngineConfig, EngineCore
from service.engine.types import GenerationRequest, SamplingParams


class Workload:
    def __init__(self, core: EngineCore, running: int) -> None:
        self.core, self.submitted = core, 0
        self.submit(running)

    def submit(self, count: int) -> None:
        requests = []
        for _ in range(count):
            k = self.submitted = self.submitted + 1
            prompt = [1 + (k * 31 + j) % 1000 for j in range(5 + k % 40)]
            params = SamplingParams(max_new_tokens=64 + (k * 37) % 128, ignore_eos=True)
            requests.append(GenerationRequest(f"r{k}", prompt, params, time.monotonic()))
        self.core.submit(requests)

    def run(self, steps: int) -> tuple[int, int]:
        """(rows stepped, steps that ran)"""
        rows = 0
        for _ in range(steps):
            out = self.core.step()
            rows += len(out.tokens)
            if ended := len(out.done) + len(out.failed):
                self.submit(ended)
        return rows, steps

    def slot_order_share(self, steps: int) -> float | None:
        """The share of launched steps whose sampled rows were read in slot order."""
        orders: list[bool | None] = []
        sampler = self.core.sampler
        launch = sampler.launch

        def recording(logits, rows, *rest, **options):
            orders.append(getattr(rows, "in_slot_order", None))
            return launch(logits, rows, *rest, **options)

        sampler.launch = recording
        try:
            self.run(steps)
        finally:
            sampler.launch = launch
        return None if not orders or None in orders else sum(orders) / len(orders)


def build_core(running: int, overlap: bool) -> EngineCore:
    from bench.common import write_random_model  # noqa: PLC0415 (the checkout's own)
    from weights.checkpoint import load_model  # noqa: PLC0415

    engine_sampler.choose_tokens = standin.standin_choose_tokens
    model = load_model(write_random_model(Path(tempfile.mkdtemp()), standin.TINY))
    core = EngineCore(model, 50256, EngineConfig(max_slots=running, max_waiting=4 * running, overlap=overlap))
    standin.install(core)
    return core


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup-steps", type=int, default=300, help="reach the churn's steady state first")
    parser.add_argument("--overlap", action="store_true", help="the core's overlap on (as on CUDA)")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    workload = Workload(build_core(args.running, args.overlap), args.running)
    workload.run(args.warmup_steps)
    started = time.process_time()
    rows, steps = workload.run(args.steps)
    cpu = time.process_time() - started
    print(json.dumps({"running": args.running, "overlap": args.overlap, "us_per_row_step": cpu / max(rows, 1) * 1e6,
                      "ms_per_step": cpu / steps * 1e3, "rows_per_step": rows / steps,
                      "slot_order_share": workload.slot_order_share(args.steps)}), flush=True)
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(workload.run, args.steps)
        pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
