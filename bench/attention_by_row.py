"""What attention row by row (model/gpt2.py `attend_by_row`, the CPU path) costs beside one
batched masked call, for GPT-2 124M's 12 layers x 12 heads x 64, side by side in one run.

    .venv/bin/python -m bench.attention_by_row --threads 1

Decode: B rows of one query each over their own cached lengths (spread over 64..512), vs one
call over the longest length with a mask (what the engine ran before). Prefill: packed rows of
different lengths, each over its own keys in query blocks at fixed positions (`attend_in_blocks`),
vs one call over the [B, longest] layout. For scale,
the last column is a whole decode step of the 124M model (random weights, float32) at that B.
Times are CPU seconds (time.process_time), best of --reps, interleaved (bench.common.interleaved).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.common import add_smoke_argument, interleaved, random_bench_model
from model.gpt2 import GPT2, AttentionInputs, attend_by_row
from model.kv_cache import KVCache

LAYERS, HEADS, HEAD_DIM = 12, 12, 64


def causal_mask(query_positions: torch.Tensor, length: int) -> torch.Tensor:
    """[B, 1, T, L]: query at position p sees keys 0..p."""
    return (torch.arange(length)[None, None, :] <= query_positions[:, :, None]).unsqueeze(1)


def attention_runs(query_counts: list[int], key_counts: list[int]) -> dict[str, object]:
    """Both ways of one layer's attention for rows of n_b queries over their L_b keys, x LAYERS."""
    B, T, L = len(query_counts), max(query_counts), max(key_counts)
    keys, values = torch.randn(2, B, HEADS, L, HEAD_DIM)
    queries = torch.randn(B, HEADS, T, HEAD_DIM)
    # Row b's queries sit at positions L_b - n_b ... L_b - 1; padding queries at 0.
    positions = torch.zeros(B, T, dtype=torch.long)
    for b, (n, length) in enumerate(zip(query_counts, key_counts)):
        positions[b, :n] = torch.arange(length - n, length)
    mask = causal_mask(positions, L)
    ctx = AttentionInputs(positions, mask, L, None, None, False, row_spans=list(zip(query_counts, key_counts)),
                          query_blocks=max(query_counts) > 1)
    rows = [queries[b : b + 1, :, :n] for b, n in enumerate(query_counts)]

    def batched() -> None:
        for _ in range(LAYERS):
            F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)

    def by_row() -> None:
        for _ in range(LAYERS):
            attend_by_row(rows, keys, values, ctx)

    return {"one batched call": batched, "row by row": by_row}


def decode_step_run(model: GPT2, key_counts: list[int]) -> object:
    cache = KVCache(model.config, max_slots=len(key_counts), max_len=max(key_counts))
    slots = cache.allocate(len(key_counts))  # rows with their blocks
    ids = torch.zeros(len(key_counts), 1, dtype=torch.long)
    positions = torch.tensor(key_counts)[:, None] - 1

    def step() -> None:
        with torch.inference_mode():
            model(ids, positions, cache, cache.batch(slots), kv_length=max(key_counts))

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.reps, args.batches = 1, [1, 2]
    model = random_bench_model(args)
    print(f"{torch.get_num_threads()} thread(s); ms of CPU time for {LAYERS} layers' attention, best of {args.reps}")
    cases = []
    for B in args.batches:
        lengths = torch.linspace(64, 512, B).round().long().tolist() if B > 1 else [288]
        cases.append((f"decode B={B:2d}", [1] * B, lengths, decode_step_run(model, lengths)))
    prompt_lengths = [20, 50] if args.smoke else [20, 100, 300, 500]
    cases.append((f"prefill {'/'.join(map(str, prompt_lengths))}", prompt_lengths, prompt_lengths, None))
    for name, query_counts, key_counts, step in cases:
        runs = attention_runs(query_counts, key_counts)
        if step is not None:
            runs["whole decode step"] = step
        best = {k: min(v) * 1e3 for k, v in interleaved(runs, args.reps, clock=time.process_time).items()}
        extra = best["row by row"] - best["one batched call"]
        line = f"{name:24s} batched {best['one batched call']:7.2f}  by row {best['row by row']:7.2f}  ({extra:+7.2f})"
        if step is not None:
            line += f"  whole step {best['whole decode step']:7.2f}"
        print(line)


if __name__ == "__main__":
    main()
