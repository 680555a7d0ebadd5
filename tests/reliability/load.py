"""A bounded mixed load against a live server on loopback: plain and streaming generation on both
APIs, tokenization, invalid requests, clients that leave mid-answer. Every answer is checked for
completeness; the result says what each request got.

Used by tests/reliability/test_load.py (CI, and the soak with RELIABILITY_SOAK=1)."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

MODEL = "gpt2"  # the default --model-name

# (kind, weight): the mix of one load run.
MIX = [
    ("generate", 4), ("generate_stream", 3), ("completion", 3), ("completion_stream", 2), ("tokenize", 2),
    ("invalid", 2), ("surrogate", 1), ("leave_stream", 1), ("leave_plain", 1), ("info", 1),
]
# Where each kind goes (the /metrics endpoint label).
ROUTES = {
    "generate": "/generate", "generate_stream": "/generate_stream", "completion": "/v1/completions",
    "completion_stream": "/v1/completions", "tokenize": "/tokenize", "invalid": "/generate", "surrogate": "/generate",
    "leave_stream": "/generate_stream", "leave_plain": "/generate", "info": "/info",
}
LEAVING = {"leave_stream", "leave_plain"}


@dataclass
class Outcome:
    kind: str
    status: int | None  # None: no HTTP status (left on purpose, or refused)
    verdict: str  # complete | error_shape | error_event | left | refused | lost | malformed
    seconds: float


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    def count(self, **match) -> int:
        return sum(all(getattr(o, k) == v for k, v in match.items()) for o in self.outcomes)

    def verdicts(self) -> Counter:
        return Counter(o.verdict for o in self.outcomes)

    def statuses(self) -> Counter:
        return Counter(str(o.status) for o in self.outcomes)

    def per_route(self) -> Counter:
        return Counter(ROUTES[o.kind] for o in self.outcomes if o.verdict != "refused")

    def percentile(self, q: float) -> float:
        done = sorted(o.seconds for o in self.outcomes if o.verdict == "complete")
        if not done:
            return float("nan")
        return statistics.quantiles(done, n=100, method="inclusive")[int(q) - 1] if len(done) > 1 else done[0]


def request_for(kind: str, rng: random.Random) -> tuple[str, dict | bytes]:
    tokens = rng.randint(1, 8)
    text = rng.choice(["Hello", "The weather today", "Once upon a time", "def f(x):", "Ünïcödé ✓"])
    if kind in ("generate", "leave_plain"):
        return "/generate", {"inputs": text, "parameters": {"max_new_tokens": 60 if kind == "leave_plain" else tokens,
                                                            "ignore_eos": kind == "leave_plain", "details": True}}
    if kind in ("generate_stream", "leave_stream"):
        return "/generate_stream", {"inputs": text, "parameters": {"max_new_tokens": 60 if kind == "leave_stream" else tokens}}
    if kind in ("completion", "completion_stream"):
        return "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": tokens,
                                   "stream": kind == "completion_stream", "temperature": rng.choice([0, 0.7])}
    if kind == "tokenize":
        return "/tokenize", {"inputs": text * rng.randint(1, 50)}
    if kind == "invalid":
        return "/generate", rng.choice([{"inputs": text, "parameters": {"temperature": -1}}, {"inputs": ""},
                                        {"inputs": text, "parameters": {"max_new_tokens": "3"}}, {"nope": 1}])
    if kind == "surrogate":
        return "/generate", b'{"inputs": "bad \\ud800 text"}'
    return "/info", {}


def well_formed_error(response: httpx.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    return is_error_body(body)


def is_error_body(body: object) -> bool:
    """TGI's {error, error_type}, or OpenAI's {error: {message, type, param, code}} (the /v1 routes')."""
    if not isinstance(body, dict):
        return False
    error = body.get("error")
    if isinstance(error, dict):
        return all(isinstance(error.get(key), str) for key in ("message", "type", "code"))
    return isinstance(error, str) and isinstance(body.get("error_type"), str)


def stream_verdict(kind: str, lines: list[str]) -> str:
    """complete, error_event (ended by a well-formed error event: the 200 was already sent when
    generation failed), or malformed."""
    events = [line[5:].strip() for line in lines if line.startswith("data:")]
    if not events:
        return "malformed"
    if events[-1] != "[DONE]":
        try:
            last = json.loads(events[-1])
        except ValueError:
            return "malformed"
        if is_error_body(last):
            return "error_event"
    if kind == "completion_stream":
        complete = events[-1] == "[DONE]" and any('"finish_reason": "' in e for e in events)
    else:
        complete = json.loads(events[-1]).get("generated_text") is not None
    return "complete" if complete else "malformed"


def judge(kind: str, status: int, text: str) -> str:
    if status != 200:
        return "error_shape" if well_formed_error(httpx.Response(status, content=text.encode())) else "malformed"
    if kind.endswith("_stream"):
        return stream_verdict(kind, text.splitlines())
    try:
        json.loads(text)
    except ValueError:
        return "malformed"
    return "complete"


async def one(client: httpx.AsyncClient, kind: str, rng: random.Random) -> Outcome:
    path, body = request_for(kind, rng)
    started = time.perf_counter()
    if isinstance(body, bytes):
        send = {"content": body, "headers": {"content-type": "application/json"}}
    else:
        send = {} if kind == "info" else {"json": body}
    # A plain request is left by timing out its read; a stream after its first event.
    timeout = httpx.Timeout(120, read=0.2) if kind == "leave_plain" else httpx.Timeout(120)
    status = None
    try:
        async with client.stream("GET" if kind == "info" else "POST", path, timeout=timeout, **send) as response:
            status = response.status_code
            chunks = []
            async for chunk in response.aiter_text():
                chunks.append(chunk)
                if kind == "leave_stream" and status == 200 and "data:" in "".join(chunks):
                    return Outcome(kind, status, "left", time.perf_counter() - started)
            text = "".join(chunks)
        checked = {"leave_stream": "generate_stream", "leave_plain": "generate"}.get(kind, kind)
        verdict = judge(checked, status, text)
    except httpx.ReadTimeout:
        verdict = "left" if kind == "leave_plain" else "lost"
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
        # No status line at all: the server never took the request (closed or gone), safe to
        # retry. After the status line: an answer was cut, which must never happen.
        verdict = "refused" if status is None else "lost"
        if verdict == "lost":
            print(f"lost {kind}: {exc!r}")
    return Outcome(kind, status, verdict, time.perf_counter() - started)


async def run_load(url: str, total: int, concurrency: int, seed: int = 0, on_progress=None) -> LoadResult:
    rng = random.Random(seed)
    kinds = rng.choices([k for k, _ in MIX], weights=[w for _, w in MIX], k=total)
    result = LoadResult()
    queue: asyncio.Queue[str] = asyncio.Queue()
    for kind in kinds:
        queue.put_nowait(kind)
    started = time.perf_counter()
    # Idle pooled connections are dropped before the server's keep-alive timeout (5 s) closes
    # them: otherwise a request sent as the server closes one is refused (a race HTTP/1.1 has).
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0)

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120), limits=limits) as client:
        async def worker(index: int) -> None:
            worker_rng = random.Random(seed * 1000 + index)
            while not queue.empty():
                kind = queue.get_nowait()
                result.outcomes.append(await one(client, kind, worker_rng))
                if on_progress is not None:
                    on_progress(len(result.outcomes))

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    result.seconds = time.perf_counter() - started
    return result
