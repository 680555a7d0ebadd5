"""Generation speed: our model and engine against transformers' generate(), same weights, same run.

    .venv/bin/python -m bench.bench_generate                 # fp32, full sizes (~8-10 min on 2 cores)
    .venv/bin/python -m bench.bench_generate --quick         # small sizes, a sanity check (~1-2 min)
    .venv/bin/python -m bench.bench_generate --dtype bfloat16 --threads 1 --only greedy

Every row alternates the two implementations run by run (see common.interleaved), and the ratio
is the median of back-to-back pairs: on a shared machine, trust the ratios over the absolutes.
Greedy and beam rows also check that both produced the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.common import DTYPES, Row, describe_machine, interleaved, load_both, paired_ratio, print_table
from model.generate import greedy_generate, greedy_generate_uncached
from model.kv_cache import KVCache
from service.inprocess import Engine, EngineConfig
from service.engine.types import GenerationRequest, SamplingParams
from weights.tokenizer import GPT2Tokenizer

SECTIONS = ("greedy", "beam", "concurrent", "prefill", "context")


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=generator)  # [count, length]


def engine_requests(prompts: torch.Tensor, params: SamplingParams) -> list[GenerationRequest]:
    now = time.monotonic()
    return [GenerationRequest(f"bench-{i}", p.tolist(), params, now) for i, p in enumerate(prompts)]


def same_tokens(a: torch.Tensor, b: torch.Tensor) -> str:
    return "same tokens" if torch.equal(a.cpu(), b.cpu()) else "TOKENS DIFFER"


def greedy_rows(ours, reference, engine, args) -> list[Row]:
    prompt = random_prompts(1, args.prompt_len, ours.config.vocab_size)
    n = args.new_tokens
    cache = KVCache(ours.config, 1, args.prompt_len + n, ours.device, ours.dtype)
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)

    def hf():
        return reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False)

    def model_loop():
        return greedy_generate(ours, prompt, n, cache)

    def engine_loop():
        return engine.generate(engine_requests(prompt, params))

    check = same_tokens(hf()[:, args.prompt_len :], model_loop())
    engine_tokens = torch.tensor([engine_loop()[0].sequences[0].token_ids])
    check_engine = same_tokens(model_loop(), engine_tokens)
    t = interleaved({"hf": hf, "model": model_loop, "engine": engine_loop}, args.reps)
    return [
        Row("greedy batch 1, model decode loop", n / statistics.median(t["hf"]),
            n / statistics.median(t["model"]), paired_ratio(t["hf"], t["model"]), check),
        Row("greedy batch 1, engine", n / statistics.median(t["hf"]),
            n / statistics.median(t["engine"]), paired_ratio(t["hf"], t["engine"]), check_engine),
    ]


def beam_rows(ours, reference, engine, args) -> list[Row]:
    prompt = random_prompts(1, args.prompt_len, ours.config.vocab_size, seed=1)
    n = args.beam_tokens
    params = SamplingParams(max_new_tokens=n, num_beams=4, ignore_eos=True)

    def hf():
        return reference.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, num_beams=4, do_sample=False
        )

    def engine_beam():
        return engine.generate(engine_requests(prompt, params))

    expected = hf()[:, args.prompt_len :]
    got = torch.tensor([engine_beam()[0].sequences[0].token_ids])
    t = interleaved({"hf": hf, "engine": engine_beam}, args.reps)
    return [
        Row("beam 4, engine", n / statistics.median(t["hf"]), n / statistics.median(t["engine"]),
            paired_ratio(t["hf"], t["engine"]), same_tokens(expected, got))
    ]


def concurrent_rows(ours, reference, engine, args) -> list[Row]:
    count, n, hf_batch = args.concurrent, args.concurrent_tokens, 8
    prompts = random_prompts(count, args.prompt_len, ours.config.vocab_size, seed=2)
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)

    def hf_static_batches():
        return [
            reference.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=n, do_sample=False)
            for batch in prompts.split(hf_batch)
        ]

    def engine_all():
        return engine.generate(engine_requests(prompts, params))

    t = interleaved({"hf": hf_static_batches, "engine": engine_all}, max(1, args.reps // 2))
    total = count * n
    return [
        Row(f"{count} requests x {n} tokens, engine vs static batch {hf_batch}",
            total / statistics.median(t["hf"]), total / statistics.median(t["engine"]),
            paired_ratio(t["hf"], t["engine"]), "aggregate tokens/s")
    ]


def prefill_rows(ours, reference, args) -> list[Row]:
    """One long prompt through the model, only the last position's logits (as generate() does)."""
    length = min(args.prefill_len, ours.config.n_positions)
    prompt = random_prompts(1, length, ours.config.vocab_size, seed=4)
    last = torch.tensor([length - 1])

    def hf():
        return reference(prompt, logits_to_keep=1).logits[:, -1]

    def model_forward():
        return ours(prompt, logits_index=last).logits

    diff = (hf().float() - model_forward().float()).abs().max().item()
    t = interleaved({"hf": hf, "model": model_forward}, args.reps)
    return [
        Row(f"prefill {length} tokens, model forward", length / statistics.median(t["hf"]),
            length / statistics.median(t["model"]), paired_ratio(t["hf"], t["model"]),
            f"max |logit diff| {diff:.1e}")
    ]


@torch.inference_mode()
def context_table(ours, args) -> None:
    """Per-token decode cost at several context lengths: one cached step vs recomputing the prefix."""
    lengths = [n for n in args.contexts if n < ours.config.n_positions]
    cache = KVCache(ours.config, 1, ours.config.n_positions, ours.device, ours.dtype)
    rows = cache.batch(cache.allocate(1))
    ids = random_prompts(1, max(lengths) + 1, ours.config.vocab_size, seed=3)
    print(f"\n{'context':>8s} {'cached ms/token':>16s} {'uncached ms/token':>18s} {'uncached/cached':>16s}")
    for length in lengths:
        ours(ids[:, :length], cache=cache, rows=rows)  # fill the cache up to `length`
        token, position = ids[:, length : length + 1], torch.tensor([[length]])

        def cached_step():
            ours(token, position, cache, rows, kv_length=length + 1)

        def uncached_step():
            ours(ids[:, : length + 1], logits_index=torch.tensor([length]))

        t = interleaved({"cached": cached_step, "uncached": uncached_step}, args.reps)
        cached, uncached = statistics.median(t["cached"]), statistics.median(t["uncached"])
        print(f"{length:8d} {cached * 1e3:16.2f} {uncached * 1e3:18.2f} {uncached / cached:15.1f}x")
    # The loops themselves agree: same tokens with and without the cache.
    prompt = ids[:, :16]
    check = same_tokens(greedy_generate(ours, prompt, 8), greedy_generate_uncached(ours, prompt, 8))
    print(f"(greedy with vs without cache: {check})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("weights/gpt2"))
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--unpacked", action="store_true", help="our model on PyTorch's default kernels (no oneDNN packing)"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes and one repetition")
    parser.add_argument("--only", choices=SECTIONS, action="append", help="run only these sections")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--beam-tokens", type=int, default=64)
    parser.add_argument("--concurrent", type=int, default=32)
    parser.add_argument("--concurrent-tokens", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--contexts", type=int, nargs="+", default=[16, 128, 256, 512, 1000])
    args = parser.parse_args()
    if args.quick:
        args.reps, args.new_tokens, args.beam_tokens, args.concurrent_tokens = 1, 32, 16, 16
        args.contexts = [16, 256, 1000]
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sections = args.only or SECTIONS
    print(describe_machine())
    print(f"{args.model_dir}, {args.dtype}, prompt {args.prompt_len} tokens, packed weights={not args.unpacked}\n")
    ours, reference = load_both(args.model_dir, DTYPES[args.dtype])
    if args.unpacked:
        ours.prepare(use_packed=False)
    tokenizer = GPT2Tokenizer.from_dir(args.model_dir)
    slots = max(args.concurrent, 4)
    max_len = args.prompt_len + max(args.new_tokens, args.beam_tokens, args.concurrent_tokens)
    engine = Engine(ours, tokenizer, EngineConfig(max_slots=slots, max_len=max_len))
    rows: list[Row] = []
    with torch.inference_mode():
        if "greedy" in sections:
            rows += greedy_rows(ours, reference, engine, args)
        if "beam" in sections:
            rows += beam_rows(ours, reference, engine, args)
        if "concurrent" in sections:
            rows += concurrent_rows(ours, reference, engine, args)
        if "prefill" in sections:
            rows += prefill_rows(ours, reference, args)
    if rows:
        print_table(rows)
    if "context" in sections:
        context_table(ours, args)
    print(f"\n{describe_machine()}")


if __name__ == "__main__":
    main()
