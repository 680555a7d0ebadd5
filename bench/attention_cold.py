"""Decode attention over the KV cache as the engine meets it: each row's keys and values read cold
(a whole model's products ran since they were last touched), row by row, for GPT-2 124M's
12 layers x 12 heads x 64. Variants of how the cache is laid out and read, side by side in one run:

    .venv/bin/python -m bench.attention_cold --threads 2 --rows 32
    .venv/bin/python -m bench.attention_cold --threads 1 --rows 1

- served: the engine's layout [slot, head, position, head_dim], one scaled_dot_product_attention
  call per row (model/gpt2.py `attend_by_row`);
- token-major: [slot, position, head, head_dim], read through a transposed view (one contiguous
  range per row and layer instead of one per head);
- bfloat16 cache: half the bytes, each row's keys and values widened to float32 before the call
  (as a bfloat16 KV cache would be read by float32 attention);
- matmul + softmax: the served layout with explicit products instead of the fused kernel;
- hot: the served call on one row's keys again and again (in cache): what the arithmetic costs.

Between layers one packed QKV-sized product runs on its own weights, as in a decode step, and
the cache is sized as the server sizes it (--max-len, default GPT-2's 1024), so the keys come
from memory, not from the CPU's caches. Printed: ms per decode step for the attention alone
(sum over layers and rows), best and median of --reps, interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import interleaved
from model.linear import linear, pack

LAYERS, HEADS, HEAD_DIM, WIDTH = 12, 12, 64, 768


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, lengths = args.rows, [64 + (37 * b) % 64 for b in range(args.rows)]  # 64..127 keys, mixed
    filled = max(lengths)
    served = torch.zeros(2, LAYERS, B, HEADS, args.max_len, HEAD_DIM)
    served[..., :filled, :].normal_()
    token_major = served.transpose(-3, -2).contiguous()  # [2, layer, slot, position, head, d]
    narrow = served.bfloat16()
    weights = [torch.randn(3 * WIDTH, WIDTH) for _ in range(LAYERS)]  # [out, in]
    packed = [pack(w) for w in weights]  # as the model's products read them
    x = torch.randn(B, WIDTH)

    def queries(layer: int) -> torch.Tensor:
        """The layer's QKV product (as in a decode step: it evicts the cache), q as the model views it."""
        qkv = linear(x, weights[layer], None, packed[layer])
        return qkv.view(B, 1, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)[0]  # [B, H, 1, d]

    def read(layer: int, b: int, n: int, how: str) -> tuple[torch.Tensor, torch.Tensor]:
        if how == "token-major":
            return token_major[0, layer, b : b + 1, :n].transpose(1, 2), token_major[1, layer, b : b + 1, :n].transpose(1, 2)
        if how == "bfloat16 cache":
            return narrow[0, layer, b : b + 1, :, :n].float(), narrow[1, layer, b : b + 1, :, :n].float()
        return served[0, layer, b : b + 1, :, :n], served[1, layer, b : b + 1, :, :n]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, how: str) -> torch.Tensor:
        if how == "matmul + softmax":
            return ((q * HEAD_DIM**-0.5) @ k.transpose(-2, -1)).softmax(-1) @ v
        return F.scaled_dot_product_attention(q, k, v)

    variants = ["served", "token-major", "bfloat16 cache", "matmul + softmax", "hot"]
    per_step: dict[str, list[float]] = {how: [] for how in variants}  # attention seconds per step

    def step(how: str):
        def run() -> None:
            total = 0.0
            for layer in range(LAYERS):
                q = queries(layer)  # outside the clock: it only evicts the caches
                for b, n in enumerate(lengths):
                    start = time.perf_counter()
                    k, v = read(layer, 0 if how == "hot" else b, n, how)
                    attend(q[b : b + 1], k, v, how)
                    total += time.perf_counter() - start
            per_step[how].append(total)
        return run

    with torch.inference_mode():
        interleaved({how: step(how) for how in variants}, args.reps)  # its own totals include the products
    print(f"{torch.get_num_threads()} thread(s), {B} rows of {min(lengths)}..{max(lengths)} keys, cache max_len {args.max_len};"
          f" attention ms per decode step ({LAYERS} layers), best / median of {args.reps}")
    base = statistics.median(per_step["served"][1:])
    for how in variants:
        times = per_step[how][1:]  # the first is the warm-up's
        median = statistics.median(times)
        print(f"  {how:18s} {min(times) * 1e3:7.2f} / {median * 1e3:7.2f}   {median / base:5.2f}x served")


if __name__ == "__main__":
    main()
