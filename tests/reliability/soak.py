"""A time-bounded mixed load against a live server on loopback, with the engine core's resident
memory sampled as it runs: the soak that shows whether the core's memory levels off.

Each client loops until the deadline over the mix: plain greedy requests, sampled ones with
`typical_p`, a JSON-schema grammar, log-probabilities with alternatives (both APIs), streams left
after a few tokens, OpenAI `echo` prompt scoring; prompts of random length up to ~700 tokens, so
prefill and decode run at ever-changing shapes. Loopback only; every loop stops by itself.

    python -m tests.reliability.soak --minutes 5 --clients 8 --threads 2 --out build/soak.json

Used by tests/reliability/test_memory_soak.py, and runnable alone to compare variants: `--env
NAME=VALUE` sets the server's environment (GPT2_CORE_HEAP_TRIM_S=0, LRU_CACHE_CAPACITY=1024,
GPT2_CORE_MEMORY_LOG=PATH: service/engine/memory.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from service.engine.memory import rss_bytes
from tests.reliability.load import judge

MODEL = "gpt2"  # the default --model-name
KINDS = ["plain", "typical", "grammar", "top_n", "openai_logprobs", "leave_stream", "echo"]
LONGEST_PROMPT_WORDS = 700  # about one token each
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue").split()


def prompt(rng: random.Random) -> str:
    # Mostly short prompts, every few requests a long one: shapes vary over the whole range.
    words = rng.randint(600, LONGEST_PROMPT_WORDS) if rng.random() < 0.3 else rng.randint(1, 200)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def request_for(kind: str, rng: random.Random) -> tuple[str, dict]:
    text, tokens = prompt(rng), rng.randint(4, 32)
    if kind == "plain":
        return "/generate", {"inputs": text, "parameters": {"max_new_tokens": tokens}}
    if kind == "typical":
        return "/generate", {"inputs": text, "parameters": {"max_new_tokens": tokens, "do_sample": True,
                                                            "typical_p": 0.9, "seed": rng.randint(0, 1 << 30)}}
    if kind == "grammar":
        return "/generate", {"inputs": text, "parameters": {"max_new_tokens": tokens,
                                                            "grammar": {"type": "json", "value": SCHEMA}}}
    if kind == "top_n":
        return "/generate", {"inputs": text, "parameters": {"max_new_tokens": tokens, "details": True, "top_n_tokens": 5,
                                                            "decoder_input_details": True}}
    if kind == "openai_logprobs":
        return "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": tokens, "logprobs": 5,
                                   "temperature": 0.8, "seed": rng.randint(0, 1 << 30)}
    if kind == "leave_stream":
        return "/generate_stream", {"inputs": text, "parameters": {"max_new_tokens": 64, "ignore_eos": True}}
    return "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": rng.choice([0, 4]), "echo": True, "logprobs": 2}


@dataclass
class SoakResult:
    verdicts: Counter = field(default_factory=Counter)  # (kind, verdict) -> count
    statuses: Counter = field(default_factory=Counter)
    rss: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, engine core RSS in MB)
    seconds: float = 0.0

    @property
    def requests(self) -> int:
        return sum(self.verdicts.values())

    def errors(self) -> int:
        """Anything but a complete answer or a stream left on purpose."""
        return sum(n for (kind, verdict), n in self.verdicts.items() if verdict not in ("complete", "left"))

    def growth_over_last_half(self) -> float:
        """Relative RSS growth from the middle of the run to its end: the median of the last tenth
        of the samples against the median of the tenth around the middle (a sample taken while a
        long prompt's activations are alive is a spike, not growth)."""
        values = [mb for _, mb in self.rss]
        tenth = max(1, len(values) // 10)
        around_middle = values[len(values) // 2 - tenth // 2:][:tenth]
        return statistics.median(values[-tenth:]) / statistics.median(around_middle) - 1

    def summary(self) -> dict:
        return {"requests": self.requests, "errors": self.errors(), "seconds": round(self.seconds, 1),
                "statuses": dict(self.statuses), "verdicts": {f"{k}/{v}": n for (k, v), n in sorted(self.verdicts.items())},
                "rss_mb": [(round(t, 1), round(mb, 1)) for t, mb in self.rss],
                "rss_first_mb": self.rss[0][1], "rss_last_mb": self.rss[-1][1],
                "growth_over_last_half": round(self.growth_over_last_half(), 4)}


def rss_mb(pid: int) -> float:
    return rss_bytes(pid) / 2**20


async def one(client: httpx.AsyncClient, kind: str, rng: random.Random) -> tuple[int | None, str]:
    path, body = request_for(kind, rng)
    async with client.stream("POST", path, json=body) as response:
        chunks = []
        async for chunk in response.aiter_text():
            chunks.append(chunk)
            if kind == "leave_stream" and response.status_code == 200 and "".join(chunks).count("data:") >= 3:
                return response.status_code, "left"  # leaving the block closes the connection
        return response.status_code, judge("generate_stream" if kind == "leave_stream" else "generate", response.status_code,
                                           "".join(chunks))


async def run_soak(url: str, core_pid: int, seconds: float, clients: int, seed: int = 0,
                   sample_every_s: float = 5.0) -> SoakResult:
    result = SoakResult()
    started = time.monotonic()
    deadline = started + seconds
    done = threading.Event()

    def sample() -> None:
        while True:
            result.rss.append((time.monotonic() - started, rss_mb(core_pid)))
            if done.wait(sample_every_s):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300), limits=limits) as client:
        async def worker(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < deadline:
                kind = rng.choice(KINDS)
                try:
                    status, verdict = await one(client, kind, rng)
                except httpx.HTTPError as exc:
                    status, verdict = None, f"lost ({type(exc).__name__})"
                result.statuses[str(status)] += 1
                result.verdicts[(kind, verdict)] += 1

        await asyncio.gather(*(worker(i) for i in range(clients)))
    result.seconds = time.monotonic() - started
    done.set()
    sampler.join()
    result.rss.append((result.seconds, rss_mb(core_pid)))
    return result


def main(argv: list[str] | None = None) -> None:
    from tests.conftest import DEFAULT_MODEL_DIR
    from tests.service.live import live_server

    parser = argparse.ArgumentParser(prog="python -m tests.reliability.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="the server's --threads")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in the server's environment (GPT2_* settings included); repeatable")
    parser.add_argument("--out", type=Path, help="write the summary (with the RSS curve) here as JSON")
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    with live_server(args.model_dir, env=env, startup_s=600, threads=args.threads) as server:
        core = server.engine_core_pid()
        result = asyncio.run(run_soak(server.url, core, args.minutes * 60, args.clients))
    summary = result.summary()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rss_mb"}, indent=1))
    print("rss", " ".join(f"{t:.0f}:{mb:.0f}" for t, mb in summary["rss_mb"]))


if __name__ == "__main__":
    main()
