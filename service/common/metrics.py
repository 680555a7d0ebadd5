"""Every Prometheus metric the service exports, defined once, in a registry owned by one app.

The names are a contract with the deployment (Grafana dashboard, HPA rule): change them there too.
A registry per app, not prometheus_client's global one, so tests can build several apps.
With --api-servers N every HTTP process records into prometheus_client's multiprocess files
(PROMETHEUS_MULTIPROC_DIR, set by service/workers.py before the process starts) and one
scrape of any of them reads them all: counters and histograms summed over the processes (the
dead ones' included, so totals never go back), the engine's gauges as last reported.

Other modules record through a `Metrics` instance (`request.app.state.service.metrics`):
    metrics.analysis_duration.observe(seconds)        # one per /analyze/* request, its analysis work
    metrics.count_fast_matrices(iterated, fallbacks)  # the fast spectral method's LAPACK fallbacks
Requests are counted by `RequestMetricsMiddleware` from the route and the response status;
a handler refines the outcome with `set_outcome(request, "cancelled")`.
"""

from __future__ import annotations

import os
import time
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics
from prometheus_client.exposition import generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.engine.types import StepStats

Outcome = Literal["success", "validation", "overloaded", "cancelled", "error"]
OUTCOMES: tuple[Outcome, ...] = ("success", "validation", "overloaded", "cancelled", "error")

# Bounded sets of buckets: latencies from a token on a fast GPU (ms) to a long CPU request (min).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
GRAMMAR_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# Routes that are not work for the model: scraping and probes would drown the request rate.
UNCOUNTED_PATHS = frozenset({"/metrics", "/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
OUTCOME_SCOPE_KEY = "gpt2.outcome"

# Drop the *_created series (one per counter and histogram child): they double the scrape and no
# dashboard reads them. A process-wide switch of prometheus_client.
disable_created_metrics()

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Every process sets the engine's gauges from the same step stats: the latest is the server's.
ENGINE_GAUGE = {"multiprocess_mode": "mostrecent"}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # prometheus_client appends _total to counters and _info to Info on exposition.
        self.requests = Counter(
            "gpt2_requests", "HTTP requests by route and outcome", ["endpoint", "outcome"], registry=r
        )
        self.request_duration = Histogram(
            "gpt2_request_duration_seconds",
            "Arrival to last byte of the response (whole stream for streaming routes)",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "gpt2_time_to_first_token_seconds", "Arrival to first generated token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.inter_token_latency = Histogram(
            "gpt2_inter_token_latency_seconds",
            "Time between consecutive tokens of one sequence",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.constrained_requests = Counter(
            "gpt2_constrained_requests", "Requests with structured output, by grammar kind", ["kind"], registry=r
        )
        self.grammar_check_seconds = Histogram(
            "gpt2_grammar_compile_seconds", "Compiling a request's grammar to check it (cache misses only)",
            buckets=GRAMMAR_BUCKETS, registry=r,
        )
        self.grammar_cache_hits = Counter(
            "gpt2_grammar_cache_hits", "Grammars found compiled already (checked before, same content)", registry=r
        )
        self.request_failures = Counter(
            "gpt2_request_failures",
            "Requests the engine failed, by cause (nonfinite_logits, grammar, beam_search: the request's own "
            "rows, the rest of the step went on; start: one that could not start, alone; step: a step that "
            "failed whole; refused; core_exit)",
            ["cause"], registry=r,
        )
        self.queue_duration = Histogram(
            "gpt2_queue_duration_seconds", "Arrival to first scheduled step", buckets=LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("gpt2_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.prompt_tokens_computed = Counter(
            "gpt2_prompt_tokens_computed", "Prompt tokens the engine ran through the model (prefill chunks)", registry=r
        )
        self.prompt_tokens_cached = Counter(
            "gpt2_prompt_tokens_cached", "Prompt tokens whose keys and values were reused from the prefix cache", registry=r
        )
        self.generated_tokens = Counter(
            "gpt2_generated_tokens", "Tokens generated, over all returned sequences", registry=r
        )
        self.prefix_cache_hits = Counter(
            "gpt2_prefix_cache_hits", "KV blocks (16 positions) admitted prompts shared from the prefix cache", registry=r
        )
        self.prefix_cache_evictions = Counter(
            "gpt2_prefix_cache_evictions", "Cached KV blocks evicted, least recently freed first, to make room", registry=r
        )
        self.kv_preemptions = Counter(
            "gpt2_kv_preemptions", "Running requests sent back to the queue (recomputed later) for want of KV blocks",
            registry=r,
        )
        self.decode_steps = Counter(
            "gpt2_decode_sequence_steps", "Sequence-steps of decoding: one pass over the weights for one sequence", registry=r
        )
        self.decode_tokens = Counter(
            "gpt2_decode_tokens", "Tokens those sequence-steps produced (more than one where drafts stood)", registry=r
        )
        self.draft_tokens = Counter("gpt2_spec_draft_tokens", "Speculative tokens drafted and verified", registry=r)
        self.accepted_tokens = Counter(
            "gpt2_spec_accepted_tokens", "Drafted tokens that matched the model's own choice", registry=r
        )
        self.requests_running = Gauge("gpt2_requests_running", "Requests holding KV-cache slots", registry=r, **ENGINE_GAUGE)
        self.requests_waiting = Gauge("gpt2_requests_waiting", "Requests queued for a free slot", registry=r, **ENGINE_GAUGE)
        self.batch_size = Histogram(
            "gpt2_batch_size", "Sequences per engine step", buckets=BATCH_BUCKETS, registry=r
        )
        self.kv_cache_usage = Gauge(
            "gpt2_kv_cache_usage_ratio", "Fraction of KV-cache slots in use", registry=r, **ENGINE_GAUGE
        )
        self.analysis_duration = Histogram(
            "gpt2_analysis_duration_seconds", "Time to run one /analyze/* request's analysis", buckets=LATENCY_BUCKETS, registry=r
        )
        self.fast_matrices = Counter(
            "gpt2_analysis_fast_matrices",
            "Attention matrices the fast spectral method iterated on: certified, or handed to LAPACK (fallback)",
            ["result"], registry=r,
        )
        for result in ("certified", "fallback"):
            self.fast_matrices.labels(result=result)
        self.model_info = Info("gpt2_model", "The model being served", registry=r)

    def declare_endpoints(self, paths: list[str]) -> None:
        """Create every (endpoint, outcome) series at 0, so rates and dashboards see them before the
        first request, and a restart is not mistaken for a missing series."""
        for path in paths:
            if path in UNCOUNTED_PATHS:
                continue
            self.request_duration.labels(endpoint=path)
            for outcome in OUTCOMES:
                self.requests.labels(endpoint=path, outcome=outcome)

    def describe_model(self, **labels: str) -> None:
        self.model_info.info({k: str(v) for k, v in labels.items()})

    def observe_step(self, stats: StepStats) -> None:
        """The engine client's per-step callback, on the event loop as each step's output arrives."""
        self.observe_step_gauges(stats)
        if stats.batch_size:
            self.batch_size.observe(stats.batch_size)
        self.prompt_tokens_computed.inc(stats.prefill_tokens)
        self.prompt_tokens_cached.inc(stats.cached_prompt_tokens)
        self.decode_steps.inc(stats.decode_tokens)
        self.decode_tokens.inc(stats.decode_output_tokens)
        self.draft_tokens.inc(stats.draft_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        self.prefix_cache_hits.inc(stats.prefix_hits)
        self.prefix_cache_evictions.inc(stats.prefix_evictions)
        self.kv_preemptions.inc(stats.preemptions)

    def observe_step_gauges(self, stats: StepStats) -> None:
        """The step's gauges alone: with --api-servers N every HTTP process gets every step's stats,
        and the scrape sums counters and histograms over the processes, so one process records
        the step's counts (observe_step) and the others only what a gauge shows."""
        self.requests_running.set(stats.running)
        self.requests_waiting.set(stats.waiting)
        self.kv_cache_usage.set(stats.kv_usage_ratio)

    def count_fast_matrices(self, iterated: int, fallbacks: int) -> None:
        """A rising share of fallbacks is the fast method failing to certify: the values stay
        right (LAPACK's), only slower (docs/spectrum.md, Methods)."""
        self.fast_matrices.labels(result="certified").inc(iterated - fallbacks)
        self.fast_matrices.labels(result="fallback").inc(fallbacks)

    def count_request(self, endpoint: str, outcome: Outcome, seconds: float) -> None:
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()
        self.request_duration.labels(endpoint=endpoint).observe(seconds)

    def expose(self) -> bytes:
        directory = os.environ.get(MULTIPROC_ENV)
        if directory is None:
            return generate_latest(self.registry)
        every_process = CollectorRegistry()
        MultiProcessCollector(every_process, path=directory)
        # Info is not kept in the multiprocess files; it is the same in every process.
        every_process.register(self.model_info)
        return generate_latest(every_process)


def set_outcome(request: Request, outcome: Outcome) -> None:
    """Override the status-derived outcome, e.g. a stream that ended because the client left."""
    request.scope[OUTCOME_SCOPE_KEY] = outcome


def outcome_for_status(status: int) -> Outcome:
    if status < 400:
        return "success"
    if status == 429 or status == 503:
        return "overloaded"
    if status < 500:
        return "validation"
    return "error"


class RequestMetricsMiddleware:
    """Counts every routed request once, with its duration, after the last byte is sent.

    Pure ASGI (not BaseHTTPMiddleware) so streaming responses pass through untouched and the
    duration covers the whole stream.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except BaseException:
            status = 500
            raise
        finally:
            endpoint = _route_path(scope)
            if endpoint is not None and endpoint not in UNCOUNTED_PATHS:
                outcome = scope.get(OUTCOME_SCOPE_KEY) or outcome_for_status(status)
                self.metrics.count_request(endpoint, outcome, time.monotonic() - start)


def _route_path(scope: Scope) -> str | None:
    # The route template, never the raw path: unmatched paths (404 probes) would make the label
    # set unbounded.
    route = scope.get("route")
    if not getattr(route, "include_in_schema", True):
        return None  # outside the API (the playground page and its assets): not counted
    return getattr(route, "path", None)
