"""What a bit-identical prefill costs: GPT-2 124M prefilling one prompt on the CPU, side by side in
one run, with its attention as
- "blocks": the engine's (model/gpt2.py `attend_in_blocks`): the queries in blocks of 32 at fixed
  positions, each block one call over the keys up to its end;
- "a row per call": one masked call per row, what the engine ran before issue 46 (its bits
  changed with where a chunk started and how long it was);
- "a query per call": each query its own call, as decoding runs it (also bit-identical however a
  prompt is cut, and equal to decoding's bits; what speculative verification runs).

    .venv/bin/python -m bench.prefill_exact --threads 1

Both run the whole model (random weights, float32 unless --quantize) through the engine's packed
prefill (`forward_from`), one prompt of each length into an empty cache; only attention differs.
Times are CPU seconds (time.process_time), best of --reps, interleaved (bench.common.interleaved).
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch

from bench.common import add_smoke_argument, interleaved, random_bench_model
from model.gpt2 import GPT2, AttentionInputs
from model.kv_cache import KVCache
from service.engine.forward import forward_from


def attend_row_masked(queries: list[torch.Tensor], keys: torch.Tensor, values: torch.Tensor, ctx: AttentionInputs,
                      attend) -> list[torch.Tensor]:
    """The attention before issue 46: row b's n_b queries in one call over its L_b keys, masked."""
    outputs = []
    for b, (q, (n, length)) in enumerate(zip(queries, ctx.row_spans)):
        positions = torch.arange(length - n, length)  # [n]
        mask = None if n == 1 else (torch.arange(length)[None, :] <= positions[:, None])[None, None]  # [1, 1, n, L]
        outputs.append(attend(q, keys[b : b + 1, :, :length], values[b : b + 1, :, :length], mask))
    return outputs


def prefill_runs(model: GPT2, length: int) -> dict[str, object]:
    cache = KVCache(model.config, max_slots=1, max_len=length)
    prompt = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()

    def blocks() -> None:
        forward_from(model, cache, [0], [0], [prompt])

    def row_per_call() -> None:
        with mock.patch("model.gpt2.attend_by_row", attend_row_masked):
            forward_from(model, cache, [0], [0], [prompt])

    def query_per_call() -> None:
        forward_from(model, cache, [0], [0], [prompt], one_query_per_call=True)

    return {"blocks": blocks, "a row per call": row_per_call, "a query per call": query_per_call}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--quantize", default="none", choices=["none", "int8", "int4"])
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.reps, args.lengths = 1, [10, 30]
    model = random_bench_model(args)
    model.quantize(args.quantize)
    print(f"{torch.get_num_threads()} thread(s), {args.quantize}; ms of CPU time for one prompt's prefill, "
          f"best of {args.reps}")
    for length in args.lengths:
        with torch.inference_mode():
            times = interleaved(prefill_runs(model, length), args.reps, clock=time.process_time)
        best = {name: min(seconds) * 1e3 for name, seconds in times.items()}
        before = best["a row per call"]
        print(f"prefill {length:5d} tokens  " + "  ".join(
            f"{name} {ms:8.1f}" + ("" if name == "a row per call" else f" ({100 * (ms / before - 1):+5.1f}%)")
            for name, ms in best.items()))


if __name__ == "__main__":
    main()
