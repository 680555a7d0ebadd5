"""Ways of adding many LoRA adapters' deltas to one batch's products, at decode shapes: GPT-2
124M's 48 adapted Conv1Ds (c_attn, both c_proj, c_fc x 12 layers), R rows spread over A adapters
of rank r, side by side in one run.

    .venv/bin/python -m bench.lora_kernels --threads 1 [--rows 16 --adapters 4 --rank 16]

- grouped, bmm of rows: per adapter, its rows gathered (index_select), each row its own
  [1, in] @ [in, r] and [1, r] @ [r, out] product in one bmm over A and B expanded (not copied),
  the second adding into the rows' outputs (baddbmm), copied back (index_copy_): model/lora.py's
  `SiteDelta`, what the model does.
- grouped, tiles of 4 rows: the same groups, each taken 4 rows at a time (the last tile padded
  with repeats), every tile a [4, in] @ [in, r] product in one bmm: a product of one shape gives
  a row the same bits wherever it sits in it, at fewer reads of A and B than one row at a time.
- grouped, packed oneDNN: the same groups, x @ A.T and @ B.T on oneDNN-packed A and B
  (model.linear, as the base products).
- grouped, matmul: the same groups with plain matmuls (MKL).
- gathered bmm: each row's own A and B gathered from the stacked adapters, one bmm each
  (Punica's BGMV, written in torch).
- row by row, packed: each row its own two packed products.
For scale, "base products" is the 48 base products of the same rows (packed oneDNN, float32).

With --model-dir (GPT-2 124M, e.g. weights/gpt2), whole [R, 1] decode steps of the model over a KV
cache of --context keys per row: every row on the base, vs the rows spread over the adapters
(all four modules, and c_attn only), each through model/lora.py; tokens/s ratios of one run.

"alone = in batch" checks each row's delta computed alone (one row, its adapter's only) against
the same row inside the batch, bit for bit: the engine's seeded sampling needs that
(docs/batch-invariance.md). Times are CPU seconds (time.process_time), best of --reps, interleaved.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import add_smoke_argument, describe_machine, interleaved
from model.config import GPT2Config
from model.kv_cache import KVCache
from model.linear import linear, pack
from model.lora import BASE, LoraSet, SiteDelta
from model.lora_format import LoraAdapter, SiteWeights, site_shapes
from weights.checkpoint import load_model

SCALING = 2.0


def make_sites(config: GPT2Config, adapters: int, rank: int, generator: torch.Generator) -> list[dict]:
    """Per adapted module: its base weight and each adapter's A, B (and packed forms)."""
    sites = []
    for _ in range(config.n_layer):
        for n_in, n_out in site_shapes(config).values():
            weight = torch.randn(n_out, n_in, generator=generator) * 0.02
            pairs = [(torch.randn(rank, n_in, generator=generator) * 0.02, torch.randn(n_out, rank, generator=generator) * 0.02)
                     for _ in range(adapters)]
            deltas = [SiteDelta(a.t().contiguous(), b.t().contiguous(), SCALING) for a, b in pairs]
            sites.append({"weight": weight, "packed": pack(weight), "deltas": deltas, "in": n_in, "out": n_out,
                          "pairs": [(a, b, pack(a), pack(b)) for a, b in pairs],
                          "stacked_a": torch.stack([d.a_t for d in deltas]),  # [adapters, in, r]
                          "stacked_b": torch.stack([d.b_t for d in deltas])})  # [adapters, r, out]
    return sites


def grouped_bmm(site, x, groups, y):
    for index, rows in groups:
        own = y.index_select(0, rows)  # [m, out]
        site["deltas"][index].add_to(own[:, None], x.index_select(0, rows)[:, None])
        y.index_copy_(0, rows, own)


TILE = 4


def grouped_tiles(site, x, groups, y):
    for index, rows in groups:
        delta = site["deltas"][index]
        tiles = -(-len(rows) // TILE)
        padded = torch.cat([rows, rows[:1].expand(tiles * TILE - len(rows))])
        low = torch.bmm(x.index_select(0, padded).view(tiles, TILE, -1), delta.a_t[None].expand(tiles, -1, -1))
        out = torch.bmm(low, delta.b_t[None].expand(tiles, -1, -1))  # [tiles, TILE, out]
        y.index_add_(0, rows, out.view(-1, out.shape[-1])[: len(rows)], alpha=delta.scaling)


def grouped_packed(site, x, groups, y):
    for index, rows in groups:
        a, b, a_packed, b_packed = site["pairs"][index]
        y.index_add_(0, rows, linear(linear(x.index_select(0, rows), a, None, a_packed) * SCALING, b, None, b_packed))


def grouped_matmul(site, x, groups, y):
    for index, rows in groups:
        a, b = site["pairs"][index][:2]
        y.index_add_(0, rows, ((x.index_select(0, rows) @ a.t()) * SCALING) @ b.t())


def gathered_bmm(site, x, adapter_of_row, y):
    a = site["stacked_a"].index_select(0, adapter_of_row)  # [R, in, r]
    b = site["stacked_b"].index_select(0, adapter_of_row)  # [R, r, out]
    y += torch.bmm(torch.bmm(x[:, None], a) * SCALING, b)[:, 0]


def row_by_row_packed(site, x, adapter_of_row, y):
    for row, index in enumerate(adapter_of_row.tolist()):
        a, b, a_packed, b_packed = site["pairs"][index]
        y[row : row + 1] += linear(linear(x[row : row + 1], a, None, a_packed) * SCALING, b, None, b_packed)


METHODS = {
    "grouped, bmm of rows": (grouped_bmm, "groups"),
    "grouped, tiles of 4 rows": (grouped_tiles, "groups"),
    "grouped, packed oneDNN": (grouped_packed, "groups"),
    "grouped, matmul": (grouped_matmul, "groups"),
    "gathered bmm": (gathered_bmm, "per_row"),
    "row by row, packed": (row_by_row_packed, "per_row"),
}


def batch_layout(adapter_of_row: list[int]):
    per_row = torch.tensor(adapter_of_row)
    groups = [(i, (per_row == i).nonzero()[:, 0]) for i in sorted(set(adapter_of_row))]
    return {"groups": groups, "per_row": per_row}


def deltas_of(method, sites, inputs, layout) -> list[torch.Tensor]:
    """Every site's delta for the batch (added to zeros)."""
    run, argument = METHODS[method]
    outputs = []
    for site, x in zip(sites, inputs):
        y = torch.zeros(len(x), site["out"])
        run(site, x, layout[argument], y)
        outputs.append(y)
    return outputs


def invariant(method, sites, inputs, adapter_of_row) -> bool:
    """Whether each row's deltas alone equal its deltas within the batch, bit for bit."""
    together = deltas_of(method, sites, inputs, batch_layout(adapter_of_row))
    for row, index in enumerate(adapter_of_row):
        alone = deltas_of(method, sites, [x[row : row + 1] for x in inputs], batch_layout([index]))
        if not all(torch.equal(a[0], t[row]) for a, t in zip(alone, together)):
            return False
    return True


def random_adapter(config: GPT2Config, rank: int, modules: tuple[str, ...], generator: torch.Generator) -> LoraAdapter:
    sites = {}
    for layer in range(config.n_layer):
        for module, (n_in, n_out) in site_shapes(config).items():
            if module in modules:
                a, b = torch.randn(rank, n_in, generator=generator) * 0.02, torch.randn(n_out, rank, generator=generator) * 0.02
                sites[f"h.{layer}.{module}"] = SiteWeights(a, b, SCALING)
    return LoraAdapter(sites, config={})


def decode_steps(model_dir, rows: int, adapters: int, rank: int, context: int, reps: int) -> None:
    """Whole decode steps, base rows vs rows over adapters, as tokens/s (one run, interleaved)."""
    model = load_model(model_dir)
    generator = torch.Generator().manual_seed(1)
    sets = {}
    for label, modules in (("all modules", tuple(site_shapes(model.config))), ("c_attn only", ("attn.c_attn",))):
        sets[label] = LoraSet(model)
        for i in range(adapters):
            sets[label].add(f"a{i}", random_adapter(model.config, rank, modules, generator))
    cache = KVCache(model.config, max_slots=rows, max_len=context + 1)
    slots = cache.allocate(rows)  # rows with their blocks
    tokens = torch.randint(0, model.config.vocab_size, (rows, 1), generator=generator)
    positions = torch.full((rows, 1), context)
    spread = [row % adapters for row in range(rows)]
    half = [BASE if row % 2 else row % adapters for row in range(rows)]

    def step(lora) -> None:
        model(tokens, positions, cache, cache.batch(slots), kv_length=context + 1, lora=lora)

    runs = {"base": lambda: step(None)}
    for label, adapter_set in sets.items():
        runs[f"{adapters} adapters, {label}"] = lambda s=adapter_set: step(s.rows(spread))
        runs[f"half base, half adapters, {label}"] = lambda s=adapter_set: step(s.rows(half))
    with torch.inference_mode():
        seconds = interleaved(runs, reps=reps, clock=time.process_time)
    base = min(seconds["base"])
    print(f"\nwhole decode steps of {model_dir}: {rows} rows, {context} cached keys each, rank {rank}; best of {reps}")
    print(f"{'rows use':44s} {'ms/step':>8s} {'tokens/s':>9s} {'vs base':>8s}")
    for name, times in seconds.items():
        best = min(times)
        print(f"{name:44s} {best * 1e3:8.1f} {rows / best:9.1f} {base / best:7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--model-dir", default=None, help="also time whole decode steps of this model")
    parser.add_argument("--context", type=int, default=128)
    add_smoke_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = GPT2Config()
    if args.smoke:
        config, args.reps = GPT2Config(n_layer=2, n_embd=64, n_head=4), 1
    generator = torch.Generator().manual_seed(0)
    sites = make_sites(config, args.adapters, args.rank, generator)
    inputs = [torch.randn(args.rows, site["in"], generator=generator) for site in sites]
    adapter_of_row = [row % args.adapters for row in range(args.rows)]
    layout = batch_layout(adapter_of_row)

    def base_products() -> None:
        for site, x in zip(sites, inputs):
            linear(x, site["weight"], None, site["packed"])

    runs = {"base products": base_products}
    for method in METHODS:
        runs[method] = lambda method=method: deltas_of(method, sites, inputs, layout)
    with torch.inference_mode():
        seconds = interleaved(runs, reps=args.reps, clock=time.process_time)
        reference = deltas_of("grouped, matmul", sites, inputs, layout)
        print(describe_machine())
        print(f"{args.rows} rows over {args.adapters} adapters, rank {args.rank}, {len(sites)} adapted products "
              f"(n_embd {config.n_embd}, {config.n_layer} layers); ms of CPU time per decode step, best of {args.reps}")
        base = min(seconds["base products"]) * 1e3
        print(f"{'method':26s} {'ms':>8s} {'vs base':>8s}  {'max |diff|':>10s}  alone = in batch")
        print(f"{'base products':26s} {base:8.3f} {1.0:7.2f}x")
        for method in METHODS:
            ms = min(seconds[method]) * 1e3
            diff = max(float((a - b).abs().max()) for a, b in zip(deltas_of(method, sites, inputs, layout), reference))
            same = "yes" if invariant(method, sites, inputs, adapter_of_row) else "NO"
            print(f"{method:26s} {ms:8.3f} {ms / base:7.2f}x  {diff:10.2e}  {same}")
    if args.model_dir:
        decode_steps(args.model_dir, args.rows, args.adapters, args.rank, args.context, max(3, args.reps // 3))


if __name__ == "__main__":
    main()
