"""Streaming HTTP clients against a real server: the prompts, the server process, one
/generate_stream request with its TTFT and gaps, and C concurrent clients (bench_serve and the
other served benchmarks drive the server through these)."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from bench.common import ServiceProcess, service_flags
from service.app import core_config
from service.inprocess import EngineConfig
from service.launch import parse_settings
from tests.processes import api_server_pids, cpu_seconds, engine_core_pid
from weights.tokenizer import GPT2Tokenizer

WORDS = "the model reads a prompt and writes tokens one at a time while other clients wait".split()


def prompt_texts(count: int, min_words: int, seed: int = 0) -> list[str]:
    """Prompts of different lengths, so the batch's shapes change from step to step."""
    generator = torch.Generator().manual_seed(seed)
    texts = []
    for i in range(count):
        length = min_words + i % 17
        picks = torch.randint(0, len(WORDS), (length,), generator=generator).tolist()
        texts.append(" ".join(WORDS[p] for p in picks))
    return texts


@dataclass
class ClientStats:
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    seconds: float = 0.0
    # CPU seconds each process spent on this run: where a served token's cost goes.
    cpu: dict[str, float] = field(default_factory=dict)

    def cpu_ms_per_token(self, process: str) -> float:
        return self.cpu[process] / max(self.tokens, 1) * 1e3


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- the server ---------------------------------------------------------------------------------
class Server(ServiceProcess):
    def __init__(self, args: argparse.Namespace, slots: int, quantize: str = "none", api_servers: int = 1,
                 checkout: Path | None = None, stream_interval: int = 1, prefix_caching: bool = True) -> None:
        """`checkout`: the folder whose code `-m service` runs (another worktree); default, this one."""
        self.label = quantize if len(args.api_servers) == 1 else f"{quantize}, {api_servers} HTTP"
        super().__init__(server_flags(args, slots, quantize, api_servers, stream_interval, prefix_caching), cwd=checkout)

    def engine_config(self, eos_token_id: int, max_len: int) -> EngineConfig:
        """The engine core's config as this server builds it from its flags (service/app.py), so
        the in-process reference admits, batches and prefills as the served engine does (a
        hand-built one queued 64 requests, and 256 clients' raised QueueFull); only max_len is
        the benchmark's longest request rather than the context, for a smaller KV cache."""
        return core_config(parse_settings(self.flags), max_len, eos_token_id).engine


def server_flags(args: argparse.Namespace, slots: int, quantize: str = "none", api_servers: int = 1,
                 stream_interval: int = 1, prefix_caching: bool = True) -> list[str]:
    """`python -m service`'s flags for a Server: the shared ones, then what differs from the defaults."""
    flags = service_flags(args, slots, args.new_tokens)
    if quantize != "none":
        flags += ["--quantize", quantize]
    if api_servers != 1:
        flags += ["--api-servers", str(api_servers)]
    if stream_interval != 1:
        flags += ["--stream-interval", str(stream_interval)]
    if not prefix_caching:  # bench_serve's rounds repeat their prompts, which a prefix cache reuses
        flags += ["--no-prefix-caching"]
    return flags


async def stream_one(http: httpx.AsyncClient, url: str, text: str, new_tokens: int, stats: ClientStats,
                     parameters: dict | None = None) -> None:
    """`parameters`: TGI parameters added to the greedy defaults (bench_serve's --top-p samples)."""
    body = {"inputs": text, "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True, **(parameters or {})}}
    await stream_ids(http, url, body, stats)


async def stream_ids(http: httpx.AsyncClient, url: str, body: dict, stats: ClientStats) -> list[int]:
    """One /generate_stream request: its token ids, with TTFT and gaps recorded in `stats`."""
    ids: list[int] = []
    start = time.perf_counter()
    last = None
    async with http.stream("POST", f"{url}/generate_stream", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"/generate_stream: {response.status_code} {(await response.aread()).decode()[:1000]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "token" not in event:
                raise RuntimeError(f"unexpected event: {event}")
            now = time.perf_counter()
            if last is None:
                stats.ttft.append(now - start)
            else:
                stats.itl.append(now - last)
            last = now
            stats.tokens += 1
            ids.append(event["token"]["id"])
    return ids


def prefill_rate(server: Server, texts: list[str], tokens: int) -> float:
    """tokens / TTFT of one prompt of `tokens` tokens at a time, the median over texts[1:] (the
    first is unmeasured); each prompt is new (random words), so the prefix cache holds at most
    its first token or two."""
    rates = []
    for text in texts:
        stats = ClientStats()
        asyncio.run(one_stream(server.url, text, stats))
        rates.append(tokens / stats.ttft[0])
    return statistics.median(rates[1:])


def long_prompts(tokenizer: GPT2Tokenizer, tokens: int, count: int) -> list[str]:
    """Texts of exactly `tokens` tokens: random words, each with its leading space (" the" is
    one token; a text's first word without one may not be)."""
    texts = []
    for seed in range(count):
        generator = torch.Generator().manual_seed(1000 + seed)
        texts.append("".join(" " + WORDS[i] for i in torch.randint(0, len(WORDS), (tokens,), generator=generator).tolist()))
        if len(tokenizer.encode(texts[-1])) != tokens:
            raise RuntimeError(f"a prefill prompt is not {tokens} tokens long")
    return texts


async def one_stream(url: str, text: str, stats: ClientStats) -> None:
    async with httpx.AsyncClient(timeout=600) as http:
        await stream_one(http, url, text, 1, stats)


def serve_clients(server: Server, texts: list[str], clients: int, per_client: int, new_tokens: int,
                  parameters: dict | list[dict] | None = None, processes: int = 1) -> ClientStats:
    """drive_clients, with the CPU time of the HTTP process, the engine core and these clients;
    `processes` > 1 spreads the clients over that many processes (drive_in_processes)."""
    # With --api-servers N the first process only supervises: the HTTP processes are its children.
    http = [server.process.pid, *api_server_pids(server.process.pid)]
    pids = {"http": http, "core": [engine_core_pid(server.process.pid)]}

    def cpu_now() -> dict[str, float]:
        return {name: sum(cpu_seconds(p) for p in group) for name, group in pids.items()} | {"clients": time.process_time()}

    before = cpu_now()
    if min(processes, clients) > 1:
        stats = drive_in_processes(server.url, texts, clients, per_client, new_tokens, parameters, processes)
    else:
        stats = asyncio.run(drive_clients(server.url, texts, clients, per_client, new_tokens, parameters))
    after = cpu_now()
    stats.cpu = {name: after[name] - before[name] for name in before} | stats.cpu
    return stats


async def drive_clients(url: str, texts: list[str], clients: int, per_client: int, new_tokens: int,
                        parameters: dict | list[dict] | None = None, indices: list[int] | None = None) -> ClientStats:
    """`clients` streaming clients, each sending `per_client` requests in turn; `parameters`: one
    dict for every client, or a list (client i takes item i mod its length); `indices`: only these
    clients of the `clients` (one process's share of them)."""
    indices = list(range(clients)) if indices is None else indices
    stats = ClientStats()
    limits = httpx.Limits(max_connections=len(indices) + 4, max_keepalive_connections=len(indices) + 4)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:

        async def client(index: int) -> None:
            own = parameters[index % len(parameters)] if isinstance(parameters, list) else parameters
            for round_ in range(per_client):
                await stream_one(http, url, texts[(index + round_ * clients) % len(texts)], new_tokens, stats, own)

        start = time.perf_counter()
        await asyncio.gather(*(client(i) for i in indices))
        stats.seconds = time.perf_counter() - start
        return stats


# One Python process's event loop reads ~10k streamed events a second (httpx, JSON): below what a
# GPU server sends to hundreds of streams, so there the clients, not the server, would set the pace.
def drive_in_processes(url: str, texts: list[str], clients: int, per_client: int, new_tokens: int,
                       parameters: dict | list[dict] | None, processes: int) -> ClientStats:
    """drive_clients with the clients dealt over `processes` spawned processes, released together
    once all have started; tokens and latencies pooled, the time from the first one's first request
    to the last one's end, and the processes' own CPU time as the clients'."""
    processes = min(processes, clients)
    context = multiprocessing.get_context("spawn")  # nothing inherited: no CUDA context, no threads
    release, results = context.Barrier(processes + 1), context.Queue()
    workers = [context.Process(target=client_process, daemon=True,
                               args=(url, texts, clients, per_client, new_tokens, parameters,
                                     list(range(clients))[i::processes], release, results))
               for i in range(processes)]
    for worker in workers:
        worker.start()
    try:
        try:
            release.wait(timeout=120)
        except threading.BrokenBarrierError:  # a worker failed to start: every one reports why
            pass
        shares = [results.get(timeout=1800) for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    failed = [share["error"] for share in shares if "error" in share]
    if failed:
        raise RuntimeError(f"a client process failed: {failed[0]}")
    # perf_counter is the system's monotonic clock: one time line for every process.
    seconds = max(share["ended"] for share in shares) - min(share["ended"] - share["seconds"] for share in shares)
    stats = ClientStats(tokens=sum(share["tokens"] for share in shares), seconds=seconds)
    for share in shares:
        stats.ttft += share["ttft"]
        stats.itl += share["itl"]
    stats.cpu = {"clients": sum(share["cpu"] for share in shares)}
    return stats


def client_process(url: str, texts: list[str], clients: int, per_client: int, new_tokens: int,
                   parameters: dict | list[dict] | None, indices: list[int], release, results) -> None:
    """One process's share of drive_in_processes' clients: one warm-up request (a fresh process's
    first one pays its imports and connection), the release, then its clients' streams."""
    try:
        try:
            asyncio.run(drive_clients(url, texts, 1, 1, 1))
        except BaseException:
            release.abort()  # the others stop waiting for this one
            raise
        release.wait(timeout=120)
        began = time.process_time()
        stats = asyncio.run(drive_clients(url, texts, clients, per_client, new_tokens, parameters, indices))
        ended = time.perf_counter()
        results.put({"tokens": stats.tokens, "ttft": stats.ttft, "itl": stats.itl, "seconds": stats.seconds, "ended": ended,
                     "cpu": time.process_time() - began})
    except Exception as exc:  # reported, not lost: the parent waits for every share
        results.put({"error": f"{type(exc).__name__}: {exc}"})
