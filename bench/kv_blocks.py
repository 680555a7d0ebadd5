"""The paged KV cache's goals and costs, counted from the engine's own steps (StepStats).

    .venv/bin/python -m bench.kv_blocks streams    # concurrent 128-in/128-out streams at 16 slots' bytes
    .venv/bin/python -m bench.kv_blocks samples    # n=16 samples of one 900-token prompt: KV bytes
    .venv/bin/python -m bench.kv_blocks gather     # a decode step: fixed slots vs gathered blocks vs runs
    python -m bench.kv_blocks streams --preset gpt2-xl --device cuda --dtype float16 \
        --streams 512 --max-batch-size 512 --kv-cache-memory-fraction 0.8   # a GPU's budget (gpu_check)

The budget is always "the bytes of 16 full-context sequences" of the model run (GPT-2 124M in
float32: 16 × 1,024 × 73.7 KB = 1.2 GB), so what fits is counted in tokens, the same for any
model of that context. By default `streams` and `samples` run a small random model with GPT-2's
context (1,024 positions) and vocabulary, 2 layers of 64: the block arithmetic of the 124M at a
fraction of its compute on a CPU; --model weights/gpt2 runs the (random) 124M itself.
`gather` always times the 124M. With --preset, `streams` runs a random model of that size built
on --device (GPT-2's initialisation drawn there: no files), and with --kv-cache-memory-fraction
the budget is the service's on a GPU (that share of the memory free after the weights) instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from model.config import PRESETS, GPT2Config
from model.gpt2 import GPT2
from model.block_tables import blocks_for
from model.kv_cache import KVCache, bytes_per_token
from service.inprocess import Engine, EngineConfig
from service.engine.types import GenerationRequest, SamplingParams
from weights.checkpoint import build_model, load_model
from weights.random_init import init_state
from weights.tokenizer import GPT2Tokenizer

SLOTS_OF_BYTES = 16  # the budget: this many full-context sequences' bytes
SMALL = GPT2Config(n_positions=1024, n_embd=64, n_layer=2, n_head=2)


def small_model() -> GPT2:
    model = GPT2(SMALL)
    model.load_state_dict(init_state(SMALL, seed=0), strict=True, assign=True)
    return model.eval()


def random_model(config: GPT2Config, device: str, dtype: torch.dtype) -> GPT2:
    """GPT-2's initialisation drawn on the device (weights/random_init.py), no files written."""
    state = {name: tensor.to(dtype) for name, tensor in init_state(config, seed=0, device=device).items()}
    return build_model(GPT2, config, state, device)


def engine_for(model: GPT2, max_batch_size: int, fraction: float | None = None) -> Engine:
    """At the bytes of 16 full-context sequences, or with `fraction`, the service's GPU budget."""
    budget = None if fraction else SLOTS_OF_BYTES * model.config.n_positions * bytes_per_token(model.config, model.dtype)
    tokenizer = GPT2Tokenizer.from_dir("weights/gpt2")
    config = EngineConfig(max_slots=max_batch_size, kv_cache_bytes=budget, kv_cache_fraction=fraction,
                          max_waiting=max(1024, 2 * max_batch_size), max_prefill_tokens=2048)
    return Engine(model, tokenizer, config)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 50000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def request(request_id: str, ids: list[int], **params) -> GenerationRequest:
    return GenerationRequest(request_id, ids, SamplingParams(**params), time.monotonic())


def run(engine: Engine, requests: list[GenerationRequest]) -> dict:
    """Step to the end; the largest decode batch, prefill tokens, peak blocks held by running rows
    (each block once, however many rows share it)."""
    engine.submit(requests)
    cache = engine.cache
    decode, prefill, peak, steps = [], 0, 0, 0
    while engine.has_work():
        stats = engine.step().stats
        decode.append(stats.decode_tokens)
        prefill += stats.prefill_tokens
        # Distinct blocks: samples of one prompt share its blocks.
        held = len({block for row in range(cache.max_slots) if cache.in_use[row] for block in cache.blocks_of(row)})
        peak, steps = max(peak, held), steps + 1
    return {"max_decode_batch": max(decode), "prefill_tokens": prefill, "peak_blocks": peak, "steps": steps,
            "preemptions": engine.scheduler.preemptions}


def streams(model: GPT2, count: int, max_batch_size: int = 256, fraction: float | None = None) -> dict:
    engine = engine_for(model, max_batch_size, fraction)
    requests = [request(f"s{i}", prompt(128, i), max_new_tokens=128, ignore_eos=True) for i in range(count)]
    began = time.perf_counter()
    result = run(engine, requests)
    cache = engine.cache
    result |= {"streams": count, "max_batch_size": max_batch_size, "kv_blocks": cache.num_blocks,
               "kv_tokens": cache.num_blocks * cache.block_size,
               "kv_gb": cache.num_blocks * cache.block_size * bytes_per_token(model.config, model.dtype) / 1e9,
               "seconds": time.perf_counter() - began, "device": str(model.device), "dtype": str(model.dtype)}
    print(f"{count} streams of 128 in / 128 out, KV budget {cache.num_blocks} blocks ({result['kv_tokens']} tokens,"
          f" {result['kv_gb']:.1f} GB), max batch {max_batch_size}: {result}")
    return result


def samples(model: GPT2) -> None:
    engine = engine_for(model, 256)
    result = run(engine, [request("n16", prompt(900, 0), max_new_tokens=32, do_sample=True, seed=1,
                                  num_return_sequences=16, ignore_eos=True)])
    one = blocks_for(932, engine.cache.block_size)
    print(f"n=16 × 32 new tokens of a 900-token prompt: {result}; one 932-token sequence holds {one} blocks:"
          f" {result['peak_blocks'] / one:.2f}x")


def gather(rows: int, length: int, rounds: int) -> None:
    """One decode step of the 124M over `rows` rows of `length` keys: a cache of fixed slots (one
    block per row: the layout before blocks), blocks interleaved between rows (a gather per
    layer), blocks in runs (a view), rows growing together in their home blocks (a view). Same
    process, alternating, min and median ms."""
    model = load_model("weights/gpt2").eval()
    config = model.config

    def cache_of(kind: str) -> tuple[KVCache, list[int]]:
        if kind == "fixed slots":
            cache = KVCache(config, rows, 1024, block_size=1024)
            return cache, cache.allocate(rows)
        # Interleaved: a pool one block short of every row at full length, so rows have no homes.
        cache = KVCache(config, rows, 1024, num_blocks=rows * 64 - (kind == "interleaved blocks"))
        slots = cache.allocate(rows, tokens=0)
        step = 16 if kind != "runs of blocks" else length + 1
        for tokens in range(step, length + 1 + step, step):
            for slot in slots:
                cache.ensure(slot, tokens)
        return cache, slots

    kinds = ("fixed slots", "interleaved blocks", "runs of blocks", "growing at home")
    setups = {kind: cache_of(kind) for kind in kinds}
    ids = torch.randint(0, 50000, (rows, length), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    logits = {}
    with torch.inference_mode():
        for kind, (cache, slots) in setups.items():
            model(ids, torch.arange(length).expand(rows, length), cache, cache.batch(slots))
        for _ in range(rounds):
            for kind, (cache, slots) in setups.items():
                started = time.perf_counter()
                logits[kind] = model(torch.zeros(rows, 1, dtype=torch.long), torch.full((rows, 1), length), cache,
                                     cache.batch(slots), kv_length=length + 1).logits
                times[kind].append(time.perf_counter() - started)
    same = all(torch.equal(logits[kinds[0]], logits[kind]) for kind in kinds)
    print(f"decode step, {rows} rows × {length} keys, {torch.get_num_threads()} threads, logits bit-identical: {same}")
    for kind in kinds:
        print(f"  {kind:20s} min {min(times[kind]) * 1e3:7.1f} ms   median {statistics.median(times[kind]) * 1e3:7.1f} ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["streams", "samples", "gather"])
    parser.add_argument("--model", "--model-dir", dest="model",
                        help="a model folder (default: a small random model with GPT-2's context)")
    parser.add_argument("--preset", choices=list(PRESETS), help="streams: a random model of this size, drawn on --device")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                        help="streams: the service's GPU budget instead of 16 full-context sequences' bytes")
    parser.add_argument("--json", help="streams: write the counts here")
    parser.add_argument("--streams", type=int, default=64, help="streams submitted at once")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="gather: rows per decode step")
    parser.add_argument("--length", type=int, default=512, help="gather: keys per row")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.what == "gather":
        for rows in args.rows:
            gather(rows, args.length, args.rounds)
        return
    dtype = getattr(torch, args.dtype)
    if args.preset:
        model = random_model(PRESETS[args.preset], args.device, dtype)
    else:
        model = load_model(args.model, args.device, dtype).eval() if args.model else small_model()
    if args.what == "samples":
        samples(model)
        return
    result = streams(model, args.streams, args.max_batch_size, args.kv_cache_memory_fraction)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
