"""What hostile requests cost the others: plain streams' inter-token gaps with and without hostile
grammars (and optionally other hostile requests) sent meanwhile, alternating on one server.

    .venv/bin/python -m bench.bench_hostile                  # 8 streams, the default 124M model, CPU fp32
    .venv/bin/python -m bench.bench_hostile --smoke          # seconds, measures nothing

One `python -m service`, then alternating rounds: --clients greedy streams (TGI
/generate_stream, ignore_eos, --new-tokens each) alone ("plain"), and the same streams while
hostile grammars that llguidance cannot follow ((a{1000}){N}, an empty-only regex, $ref loops, an
array of itself, 2,000 properties) are sent one after another ("grammars"). Printed: each round
kind's gap p50 / p99 / max (every round's gaps together), their ratio to plain (the goal: p99 at
most 1.5x), and each hostile answer's status and time. A hostile request answered 2xx, or a
plain stream that fails, ends the run with exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import httpx

from bench.serve_clients import ClientStats, percentile, prompt_texts, stream_ids
from bench.common import ServiceProcess, add_server_arguments, add_smoke_argument, describe_machine, service_flags

GRAMMARS = [
    *({"type": "regex", "value": "(a{1000}){%d}" % n} for n in range(1001, 1006)),
    {"type": "regex", "value": r"[^\s\S]"},
    {"type": "json", "value": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}},
    {"type": "json", "value": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
    {"type": "json", "value": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}},
]


async def hostile(http: httpx.AsyncClient, url: str, answers: list[tuple[int, float]]) -> None:
    await asyncio.sleep(0.5)  # the streams are decoding by then
    for grammar in GRAMMARS:
        start = time.perf_counter()
        body = {"inputs": "Answer:", "parameters": {"max_new_tokens": 16, "grammar": grammar}}
        response = await http.post(f"{url}/generate", json=body)
        answers.append((response.status_code, time.perf_counter() - start))


async def round_(url: str, texts: list[str], new_tokens: int, with_hostile: bool) -> tuple[ClientStats, list]:
    stats, answers = ClientStats(), []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(texts) + 4), timeout=600) as http:
        body = lambda text: {"inputs": text, "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True}}  # noqa: E731
        tasks = [stream_ids(http, url, body(text), stats) for text in texts]
        if with_hostile:
            tasks.append(hostile(http, url, answers))
        await asyncio.gather(*tasks)
    return stats, answers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser, Path("weights/gpt2"), ("grammars",))
    add_smoke_argument(parser)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        args.clients, args.new_tokens, args.rounds = 2, 8, 1
    print(f"{describe_machine()}; {args.model_dir} on {args.device} {args.dtype}", flush=True)
    texts = prompt_texts(args.clients, 8)
    gaps: dict[str, list[float]] = {"plain": [], "grammars": []}
    answers: list[tuple[int, float]] = []
    with ServiceProcess(service_flags(args, args.clients + 4, args.new_tokens)) as server:
        server.wait_ready()
        asyncio.run(round_(server.url, texts, 4, False))  # first-request costs are not the measure
        for _ in range(args.rounds):  # alternating, so a change of the machine's load shows in both
            for kind in gaps:
                stats, got = asyncio.run(round_(server.url, texts, args.new_tokens, kind == "grammars"))
                gaps[kind] += stats.itl
                answers += got
    print(f"{args.clients} greedy streams, {args.new_tokens} new tokens each, {args.rounds} rounds of each kind; "
          f"{len(GRAMMARS)} hostile grammars per 'grammars' round")
    print(f"{'round':>10} {'gaps':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99 / plain':>12}")
    plain_p99 = percentile(gaps["plain"], .99)
    for kind, values in gaps.items():
        p99 = percentile(values, .99)
        print(f"{kind:>10} {len(values):7d} {percentile(values, .5) * 1e3:8.1f} {p99 * 1e3:8.1f} {max(values) * 1e3:8.1f} "
              f"{p99 / plain_p99:12.2f}")
    statuses = sorted({status for status, _ in answers})
    print(f"hostile answers: statuses {statuses}, time p50 {percentile([t for _, t in answers], .5) * 1e3:.0f} ms, "
          f"max {max(t for _, t in answers) * 1e3:.0f} ms")
    ratio = percentile(gaps["grammars"], .99) / plain_p99
    print(f"p99 with hostile grammars / plain: {ratio:.2f} (goal <= 1.5: {'met' if ratio <= 1.5 else 'NOT met'})")
    return 0 if all(400 <= status < 500 for status in statuses) else 1


if __name__ == "__main__":
    raise SystemExit(main())
