"""The device's own pace on our weights: the hardware anchor every served figure is divided by.

    .venv/bin/python -m bench.cuda_anchor --device cuda --dtype float16 --batch 1 16 64 256
    .venv/bin/python -m bench.cuda_anchor --device cpu --batch 1 2 --steps 4   # smoke: the same code, eagerly

gpt-fast's recipe: one greedy decode step of our model (forward over the preallocated KV cache,
argmax, the next position), every part of it on the device, captured as one CUDA graph and replayed
back to back. No scheduling, no sampling options, no host work and no device→host copy between
steps: what a served step could cost at best on these weights and batch sizes. Each batch row
starts at --start (a prompt's length) and decodes --steps tokens, reading keys up to the length
bucket the engine's own graphs use for that span (service/engine/graphs.py), so the attention
work matches what the server does for --new-tokens tokens after a short prompt.

What it leaves out, on purpose: prefill, sampling beyond argmax, stop checks, streaming. The
ratio served / anchor is therefore the share of the device's pace the server delivers.
On the CPU the step runs eagerly (no graphs): only a smoke run, so the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from model.config import DTYPES
from model.kv_cache import KVCache
from model.paged_attention import DECODE_ATTENTION
from service.engine.graphs import SMALLEST_LENGTH_BUCKET, ladder, next_size
from weights.checkpoint import load_model


class GreedyStep:
    """Buffers a step reads and writes in place, so the step can be one graph."""

    def __init__(self, model, batch: int, start: int, steps: int, decode_attention: str = "gather") -> None:
        config = model.config
        self.model, self.start = model, start
        self.cache = KVCache(config, batch, config.n_positions, model.device, model.dtype, decode_attention=decode_attention)
        self.rows = self.cache.batch(self.cache.allocate(batch))  # rows with their blocks
        buckets = ladder(config.n_positions, min(SMALLEST_LENGTH_BUCKET, config.n_positions))
        self.kv_length = next_size(buckets, start + steps)
        generator = torch.Generator().manual_seed(batch)
        self.input_ids = torch.randint(0, config.vocab_size, (batch, 1), generator=generator).to(model.device)
        self.positions = torch.full((batch, 1), start, dtype=torch.long, device=model.device)

    def __call__(self) -> None:
        out = self.model(self.input_ids, self.positions, self.cache, self.rows, kv_length=self.kv_length,
                         exact_kv_length=False)
        self.input_ids.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
        self.positions.add_(1)

    def rewind(self) -> None:
        self.positions.fill_(self.start)


def captured(step: GreedyStep):
    """The step as a replayable CUDA graph (warmed up on a side stream first, as torch asks)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


@torch.inference_mode()
def anchor_rate(model, batch: int, start: int, steps: int, reps: int, decode_attention: str = "gather") -> dict:
    """tok/s and ms per step of `steps` greedy steps at `batch` rows, the best of `reps` runs."""
    step = GreedyStep(model, batch, start, steps, decode_attention)
    run = captured(step) if model.device.type == "cuda" else step
    seconds = []
    for _ in range(reps + 1):
        step.rewind()
        synchronize(model.device)
        began = time.perf_counter()
        for _ in range(steps):
            run()
        synchronize(model.device)
        seconds.append(time.perf_counter() - began)
    best = min(seconds[1:])  # the first run warms up
    return {"batch": batch, "tokens_per_s": batch * steps / best, "ms_per_step": best / steps * 1e3,
            "kv_length": step.kv_length, "graph": model.device.type == "cuda", "decode_attention": decode_attention}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(model_dir: Path, device: str, dtype: str, batches: list[int], start: int, steps: int, reps: int,
            decode_attention: str = "gather", model=None) -> list[dict]:
    """`decode_attention`: the engine's option (model/paged_attention.py); the default is the anchor."""
    model = model or load_model(model_dir, device=device, dtype=DTYPES[dtype])
    rows = []
    for batch in batches:
        rows.append(anchor_rate(model, batch, start, steps, reps, decode_attention))
        if device == "cuda":
            torch.cuda.empty_cache()  # each batch's cache is its own; the next starts from a clean pool
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("weights/gpt2"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--start", type=int, default=16, help="each row's position before its first step")
    parser.add_argument("--steps", type=int, default=128, help="decode steps per run (new tokens per row)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--decode-attention", choices=DECODE_ATTENTION, default="gather",
                        help="how attention reads the cache's blocks (paged: the Triton kernel; CUDA)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = measure(args.model_dir, args.device, args.dtype, args.batch, args.start, args.steps, args.reps,
                   args.decode_attention)
    print(f"{args.model_dir}, {args.device} {args.dtype}, {args.decode_attention} attention: one greedy decode step"
          f"{' as one CUDA graph' if args.device == 'cuda' else ' (eager: no graphs on the CPU)'}, {args.steps} steps from position {args.start}")
    print(f"{'batch':>6s} {'tok/s':>12s} {'ms/step':>9s} {'keys read':>10s}")
    for row in rows:
        print(f"{row['batch']:6d} {row['tokens_per_s']:12.0f} {row['ms_per_step']:9.3f} {row['kv_length']:10d}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
