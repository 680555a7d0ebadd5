"""The engine core's overlap, measured where it can pay: the core alone, overlap off against on,
in one run, on the same weights and requests.

    .venv/bin/python -m bench.bench_overlap --device cuda --dtype float16 --batch 1 16 64 256
    .venv/bin/python -m bench.bench_overlap --batch 1 8        # CPU: the code path, no gain expected

Per batch size B: B greedy requests (distinct random prompts of --prompt-tokens, ignore_eos,
--new-tokens each) submitted at once to an in-process EngineCore, stepped until all are done;
overlap off, then on, alternating for --rounds rounds (best of each). Printed: tokens/s off and on
and their ratio, and whether every token matched. On CUDA also the synchronising CUDA calls per
overlapped step (torch's sync debug mode) with the lines that made them: each one holds the host
until the device has run everything queued, which is the time overlap exists to use.

What this leaves out: HTTP, detokenizing and the IPC between processes (gpu_check's serve part
measures those), and requests arriving or finishing at different times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

from bench.common import describe_machine
from model.config import DTYPES
from service.engine.core import EngineConfig, EngineCore
from service.engine.types import GenerationRequest, SamplingParams
from weights.checkpoint import load_model


def requests(batch: int, prompt_tokens: int, new_tokens: int, vocab: int, tag: str) -> list[GenerationRequest]:
    generator = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    return [GenerationRequest(f"{tag}-{i}", torch.randint(0, vocab, (prompt_tokens,), generator=generator).tolist(), params, 0.0)
            for i in range(batch)]


def run(core: EngineCore, batch: list[GenerationRequest], count_syncs: bool) -> tuple[float, dict, Counter, int]:
    """Seconds to finish the batch, each request's tokens, synchronising calls by source line, steps."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in batch}
    syncs: Counter = Counter()
    core.submit(batch)
    steps = 0
    if core.device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if count_syncs:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            while core.has_work():
                step = core.step()
                steps += 1
                for request_id, _, token, *_ in step.tokens:
                    tokens[request_id].append(token)
        finally:
            if count_syncs:
                torch.cuda.set_sync_debug_mode("default")
    seconds = time.perf_counter() - began
    for warning in caught:
        if "synchroniz" in str(warning.message):
            syncs[f"{Path(warning.filename).name}:{warning.lineno}"] += 1
    return seconds, tokens, syncs, steps


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    model = load_model(args.model_dir, device=device, dtype=DTYPES[args.dtype])
    rows = []
    for batch in args.batch:
        max_len = args.prompt_tokens + args.new_tokens
        cores = {overlap: EngineCore(model, model.config.vocab_size - 1,
                                     EngineConfig(max_slots=batch, max_len=max_len, max_waiting=batch, overlap=overlap,
                                                  static_decode=args.cuda_graphs and device.type == "cuda",
                                                  max_prefill_tokens=max(512, args.prompt_tokens)))
                 for overlap in (False, True)}
        best: dict[bool, float] = {}
        outputs: dict[bool, dict] = {}
        syncs, steps = Counter(), 0
        for round_ in range(args.rounds + 1):  # round 0 warms up (allocator, kernels' first calls)
            for overlap, core in cores.items():
                tag = f"r{round_}"
                seconds, tokens, found, n = run(core, requests(batch, args.prompt_tokens, args.new_tokens,
                                                               model.config.vocab_size, tag),
                                                count_syncs=overlap and device.type == "cuda" and round_ == args.rounds)
                outputs[overlap] = {k.split("-", 1)[1]: v for k, v in tokens.items()}
                if found:
                    syncs, steps = found, n
                if round_:
                    best[overlap] = min(best.get(overlap, float("inf")), seconds)
        generated = batch * args.new_tokens
        row = {"batch": batch, "off_tok_s": generated / best[False], "on_tok_s": generated / best[True],
               "on_over_off": best[False] / best[True], "identical": outputs[False] == outputs[True],
               "syncs_per_step": sum(syncs.values()) / steps if steps else None, "sync_sources": dict(syncs.most_common(8))}
        rows.append(row)
        print(f"B={batch:4d}  off {row['off_tok_s']:9.0f} tok/s  on {row['on_tok_s']:9.0f} tok/s  on/off "
              f"{row['on_over_off']:.2f}  identical {row['identical']}"
              + (f"  syncs/step {row['syncs_per_step']:.2f} {row['sync_sources']}" if row["syncs_per_step"] is not None else ""),
              flush=True)
    return {"machine": describe_machine(), "device": str(device), "dtype": args.dtype, "rows": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("weights/gpt2"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", type=Path, help="write the numbers here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"{describe_machine()}; {args.model_dir} on {args.device} {args.dtype}", flush=True)
    result = measure(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if all(row["identical"] for row in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
