"""Structured output as users get it: validity of constrained answers, and their cost beside free
ones, from the real server over HTTP (docs/structured-output.md).

    .venv/bin/python -m bench.bench_structured                      # the default model, 1,000 answers
    .venv/bin/python -m bench.bench_structured --generations 200 --clients 16

One server (`python -m service`, its engine core in its own process). Printed:
- validity: --generations constrained /generate answers (sampled, a seed each; JSON schemas from
  bench/grammar_schemas.py and tests' bounded ones, and regexes): how many ended by the grammar
  (`eos_token`), how many of those parse and validate (jsonschema, re.fullmatch), how many ran
  into max_new_tokens first (an untrained model may still be inside a string then);
- speed: C streaming clients all constrained to one JSON schema, then C free ones (same prompts,
  ignore_eos off, the same max_new_tokens), alternating rounds: tok/s and TTFT p50 of each, and
  constrained / free. The goals: tok/s at least 0.9x, TTFT at most 1.2x, at 1 and 16 clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from pathlib import Path

import httpx
import jsonschema

from bench.serve_clients import ClientStats, percentile, prompt_texts, stream_ids
from bench.common import ServiceProcess, add_smoke_argument, describe_machine, service_flags
from bench.grammar_schemas import SCHEMAS

# Every value bounded: an answer ends within a few hundred tokens whatever the model.
BOUNDED = {"type": "object", "properties": {
    "label": {"enum": ["yes", "no", "maybe"]},
    "score": {"type": "integer", "minimum": 0, "maximum": 100},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "note": {"type": "string", "maxLength": 12},
    "ok": {"type": "boolean"},
}, "required": ["label", "score", "tags", "note", "ok"], "additionalProperties": False}
# [0-9], not \d: llguidance's \d is Unicode's digit class (Rust's regex, Unicode 16), which
# Python 3.11's re (Unicode 15) does not know in full: U+1CCF1 matches one and not the other.
REGEXES = [r"(cat|dog|bird)-[0-9]{3}", r"[A-Z][a-z]{2,8}( [a-z]{2,8}){0,3}\.", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"]


def grammars() -> list[tuple[dict, object]]:
    """(TGI grammar, what its answers must satisfy): a schema dict or a compiled regex."""
    found = [({"type": "json", "value": BOUNDED}, BOUNDED)]
    found += [({"type": "json", "value": schema}, schema) for _, schema, _ in SCHEMAS]
    found += [({"type": "regex", "value": regex}, re.compile(regex)) for regex in REGEXES]
    return found


async def validity(url: str, count: int, clients: int, max_new_tokens: int) -> dict[str, int]:
    tally = {"ended by the grammar": 0, "valid": 0, "invalid": 0, "cut by max_new_tokens": 0}
    cases = grammars()
    texts = prompt_texts(17, 4)
    queue = list(range(count))

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            index = queue.pop()
            grammar, check = cases[index % len(cases)]
            body = {"inputs": texts[index % len(texts)], "parameters": {
                "max_new_tokens": max_new_tokens, "grammar": grammar, "do_sample": True, "seed": index, "details": True}}
            response = await http.post(f"{url}/generate", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"/generate answered {response.status_code}: {response.text[:500]}")
            answer = response.json()
            text, reason = answer["generated_text"], answer["details"]["finish_reason"]
            if reason == "length":
                tally["cut by max_new_tokens"] += 1
                continue
            tally["ended by the grammar"] += 1
            tally["valid" if satisfies(text, check) else "invalid"] += 1

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return tally


def satisfies(text: str, check: object) -> bool:
    if isinstance(check, re.Pattern):
        return check.fullmatch(text) is not None
    try:
        jsonschema.validate(json.loads(text), check)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def streams(url: str, texts: list[str], clients: int, new_tokens: int, grammar: dict | None) -> ClientStats:
    stats = ClientStats()
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:
        async def one(index: int) -> None:
            parameters = {"max_new_tokens": new_tokens, "do_sample": True, "seed": index}
            if grammar is not None:
                parameters["grammar"] = grammar
            await stream_ids(http, url, {"inputs": texts[index % len(texts)], "parameters": parameters}, stats)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(clients)))
        stats.seconds = time.perf_counter() - start
    return stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("weights/gpt2"))
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the engine core")
    parser.add_argument("--generations", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=300)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--stream-tokens", type=int, default=64, help="max_new_tokens of the speed rounds")
    parser.add_argument("--rounds", type=int, default=3)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.generations, args.max_new_tokens, args.clients, args.stream_tokens, args.rounds = 8, 60, [2], 8, 1
    args.device, args.dtype = "cpu", "float32"
    print(describe_machine(), flush=True)
    with ServiceProcess(service_flags(args, max(max(args.clients), 16), args.max_new_tokens)) as server:
        server.wait_ready()
        tally = asyncio.run(validity(server.url, args.generations, 16, args.max_new_tokens))
        print(f"validity, {args.generations} constrained answers ({len(grammars())} grammars, sampled, a seed each): "
              + ", ".join(f"{name} {count}" for name, count in tally.items()), flush=True)
        schema = {"type": "json", "value": SCHEMAS[0][1]}
        texts = prompt_texts(17, 8)
        print(f"{'clients':>7s} {'constrained tok/s':>18s} {'free tok/s':>11s} {'ratio':>6s} {'TTFT p50 ms constrained':>24s} {'free':>6s} {'ratio':>6s}")
        for clients in args.clients:
            runs: dict[str, list[ClientStats]] = {"constrained": [], "free": []}
            for round_ in range(args.rounds):
                for name in ("constrained", "free") if round_ % 2 == 0 else ("free", "constrained"):
                    grammar = schema if name == "constrained" else None
                    runs[name].append(asyncio.run(streams(server.url, texts, clients, args.stream_tokens, grammar)))
            rate = {name: statistics.median(s.tokens / s.seconds for s in r) for name, r in runs.items()}
            ttft = {name: statistics.median(percentile(s.ttft, 0.5) for s in r) * 1e3 for name, r in runs.items()}
            print(f"{clients:7d} {rate['constrained']:18.1f} {rate['free']:11.1f} {rate['constrained'] / rate['free']:6.2f}"
                  f" {ttft['constrained']:24.1f} {ttft['free']:6.1f} {ttft['constrained'] / ttft['free']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
