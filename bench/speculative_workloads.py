"""The client side of bench_speculative: held-out prompts for its two workloads, the streaming
requests that record each token id, the /metrics counters read around a workload, how much of a
grounded output was quoted from its passage, and the drafter's own cost timed in process.
Servers, the table and the command line are bench/bench_speculative.py's.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.serve_clients import ClientStats, percentile, stream_ids
from service.engine.ngram_drafter import NgramIndex, NgramSettings
from tests.processes import cpu_seconds
from weights.corpus import Work
from weights.tokenizer import GPT2Tokenizer

SPEC_COUNTERS = (
    "gpt2_spec_draft_tokens_total",
    "gpt2_spec_accepted_tokens_total",
    "gpt2_decode_sequence_steps_total",
    "gpt2_decode_tokens_total",
)


# --- prompts ------------------------------------------------------------------------------------
@dataclass
class Request:
    key: str
    body: dict
    prompt_ids: list[int]
    passage_ids: list[int] = field(default_factory=list)  # grounded only: what quoting would repeat


def passages(works: list[Work], tokenizer: GPT2Tokenizer, count: int, tokens: int, region: tuple[float, float]) -> list[tuple[str, list[int]]]:
    """`count` passages of exactly `tokens` tokens, each starting at a line start, taken in turn
    from each work and spread evenly over the fraction `region` of its lines. Distinct regions
    keep the two workloads' prompts apart. Starting at a line keeps the passage readable, which
    matters for the sample printed beside the model's output."""
    per_work = [count // len(works) + (i < count % len(works)) for i in range(len(works))]
    found: list[list[tuple[str, list[int]]]] = []
    for work, wanted in zip(works, per_work):
        lines = [line for line in work.text.splitlines(keepends=True)]
        low, high = int(region[0] * len(lines)), int(region[1] * len(lines))
        taken = []
        for i in range(wanted):
            start = low + (high - low) * i // max(wanted, 1)
            # Skip blank lines so no passage opens on a gap.
            while start < len(lines) - 1 and not lines[start].strip():
                start += 1
            text, end = "", start
            while end < len(lines) and len(tokenizer.encode(text)) < tokens + 8:
                text += lines[end]
                end += 1
            ids = tokenizer.encode(text)[:tokens]
            if len(ids) < tokens:
                raise SystemExit(f"{work.name}: too little text for a {tokens}-token passage at line {start}")
            taken.append((tokenizer.decode(ids), ids))
        found.append(taken)
    # Interleave the works, so a workload's first requests are not all one play.
    ordered = [p for group in zip(*[w + [None] * (max(per_work) - len(w)) for w in found]) for p in group]
    return [p for p in ordered if p is not None]


def grounded_requests(works, tokenizer, count: int, passage_tokens: int, repeat_tokens: int, new_tokens: int,
                      n_positions: int, prefix: str) -> list[Request]:
    """Passage, a blank line, then the passage's first tokens again: a model that quotes its input
    would go on repeating the passage, which is what n-gram drafts bet on."""
    requests = []
    for i, (text, ids) in enumerate(passages(works, tokenizer, count, passage_tokens, (0.05, 0.5))):
        prompt = text + "\n\n" + tokenizer.decode(ids[:repeat_tokens])
        prompt_ids = tokenizer.encode(prompt)
        new = min(new_tokens, n_positions - len(prompt_ids))
        if new < 1:
            raise SystemExit(f"a {len(prompt_ids)}-token grounded prompt leaves no room in the {n_positions}-token context")
        body = {"inputs": prompt, "parameters": {"max_new_tokens": new, "ignore_eos": True}}
        requests.append(Request(f"{prefix}-{i}", body, prompt_ids, ids))
    return requests


def open_requests(works, tokenizer, count: int, prompt_tokens: int, new_tokens: int, n_positions: int,
                  temperature: float, top_p: float, seed: int, prefix: str) -> list[Request]:
    """Short held-out snippets, continued by sampling. A fixed seed per request makes the
    sampled tokens the same on both servers, so they can be compared token for token.
    ignore_eos keeps every request the same length on both sides, whatever it samples."""
    requests = []
    for i, (text, ids) in enumerate(passages(works, tokenizer, count, prompt_tokens, (0.55, 0.95))):
        new = min(new_tokens, n_positions - len(ids))
        parameters = {"max_new_tokens": new, "ignore_eos": True, "do_sample": True, "temperature": temperature,
                      "top_p": top_p, "seed": seed + i}
        requests.append(Request(f"{prefix}-{i}", {"inputs": text, "parameters": parameters}, ids))
    return requests


# --- clients ------------------------------------------------------------------------------------
async def drive(url: str, requests: list[Request], clients: int) -> tuple[ClientStats, dict[str, list[int]]]:
    """`clients` concurrent clients; client c sends requests c, c + clients, ... one after another
    (bench_serve's drive_clients, with bodies of their own)."""
    stats, outputs = ClientStats(), {}
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:

        async def client(index: int) -> None:
            for request in requests[index::clients]:
                outputs[request.key] = await stream_ids(http, url, request.body, stats)

        start = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        stats.seconds = time.perf_counter() - start
    return stats, outputs


def summarize(stats: ClientStats) -> dict:
    return {"tokens": stats.tokens, "seconds": stats.seconds, "tok_s": stats.tokens / stats.seconds,
            "ttft_p50_ms": percentile(stats.ttft, 0.5) * 1e3, "itl_p50_ms": percentile(stats.itl, 0.5) * 1e3,
            "requests": len(stats.ttft)}


def spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = {name: 0.0 for name in SPEC_COUNTERS}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] += sample.value
    return found


def spec_rates(delta: dict[str, float]) -> dict[str, float | None]:
    draft, accepted = delta["gpt2_spec_draft_tokens_total"], delta["gpt2_spec_accepted_tokens_total"]
    steps, tokens = delta["gpt2_decode_sequence_steps_total"], delta["gpt2_decode_tokens_total"]
    return {"acceptance": accepted / draft if draft else None, "tokens_per_forward": tokens / steps if steps else None,
            "draft_tokens": draft, "accepted_tokens": accepted, "sequence_steps": steps, "decode_tokens": tokens}


# --- other processes on the machine -------------------------------------------------------------
def machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has used (/proc/stat: all but idle and iowait)."""
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class CpuWatch:
    """The share of the machine's CPUs that processes other than ours (the server, its engine
    core, this client) used over an interval. On a shared machine a stall in one server's run
    reads as a ratio; this says when to distrust a row."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def _ours(self) -> float:
        return sum(cpu_seconds(pid) for pid in self.pids) + time.process_time()

    def __enter__(self) -> CpuWatch:
        self.start = (time.perf_counter(), machine_busy_seconds(), self._ours())
        return self

    def __exit__(self, *exc) -> None:
        wall, busy, ours = (b - a for a, b in zip(self.start, (time.perf_counter(), machine_busy_seconds(), self._ours())))
        self.others = max(0.0, busy - ours) / (wall * (os.cpu_count() or 1))


# --- where a grounded output's tokens came from -------------------------------------------------
def quote_profile(passage: list[int], output: list[int], repeat_tokens: int, n: int = 4) -> dict:
    """How much of an output is the passage quoted, and how much the output repeating itself:
    `verbatim`, tokens equal to the passage's own continuation before the first difference;
    of the output's n-grams, the fraction found in the passage (`from_passage`), and the fraction
    found only earlier in the output itself (`self_repeat`). Both kinds make n-gram drafts stand."""
    continuation = passage[repeat_tokens:]
    verbatim = next((i for i, (a, b) in enumerate(zip(output, continuation)) if a != b), min(len(output), len(continuation)))
    in_passage = {tuple(passage[i:i + n]) for i in range(len(passage) - n + 1)}
    seen: set[tuple[int, ...]] = set()
    quoted = repeated = total = 0
    for i in range(len(output) - n + 1):
        gram = tuple(output[i:i + n])
        total += 1
        if gram in in_passage:
            quoted += 1
        elif gram in seen:
            repeated += 1
        seen.add(gram)
    return {"verbatim": verbatim, "from_passage": quoted / max(total, 1), "self_repeat": repeated / max(total, 1)}


def quote_summary(requests: list[Request], outputs: dict[str, list[int]], repeat_tokens: int) -> dict:
    profiles = [quote_profile(r.passage_ids, outputs[r.key], repeat_tokens) for r in requests if r.key in outputs]
    return {key: statistics.median(p[key] for p in profiles) for key in ("verbatim", "from_passage", "self_repeat")}


# --- the drafter's own cost ---------------------------------------------------------------------
def drafter_cost(sequences: list[list[int]], start: int, settings: NgramSettings, repeats: int) -> dict:
    """Microseconds per sequence per step of NgramIndex.draft in a decode-like loop: every sequence
    drafts once per step, then grows by one token (appended in place, as the engine's token list
    does), from `start` tokens to its full length. The index's catch-up over the prompt on the
    first step is counted too: it is part of what a request costs."""
    per_step = []
    steps = len(sequences[0]) - start
    for _ in range(repeats):
        grown = [s[:start] for s in sequences]
        indexes = [NgramIndex(settings) for _ in sequences]
        drafted = 0
        begin = time.perf_counter()
        for position in range(start, len(sequences[0])):
            for tokens, index, full in zip(grown, indexes, sequences):
                drafted += len(index.draft(tokens, settings.tokens))
                tokens.append(full[position])
        per_step.append((time.perf_counter() - begin) / (steps * len(sequences)) * 1e6)
    return {"us_per_sequence_step": statistics.median(per_step), "runs_us": per_step, "sequences": len(sequences),
            "steps": steps, "start_tokens": start, "drafted_per_step": drafted / (steps * len(sequences))}


def drafter_sequences(works: list[Work], tokenizer: GPT2Tokenizer, count: int, length: int) -> list[list[int]]:
    """Held-out token windows: real text, so look-ups hit and miss as they do when serving."""
    return [ids for _, ids in passages(works, tokenizer, count, length, (0.0, 0.95))]
