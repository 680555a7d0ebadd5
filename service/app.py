"""Builds the FastAPI application: reads the model's config and tokenizer, starts the engine core
and the analysis process, mounts the routes.

Above both sides (with service/routes_adapters.py, which speaks to both processes): it imports
service/http/ and service/analysis/, which import each other not at all, only service/common/
below them (tests/model/test_layering.py).

Request path: Framing (400: CL+TE) → HostAllowList (400, optional) → Drain (503 after SIGTERM)
→ BearerAuth (optional) → RequestMetrics → BodyLimit (413 before parsing)
→ route → schemas/admission (422) → Generations → EngineClient → (IPC) engine core process
→ token ids → OutputProcessor (text, stop strings) → back as events.
No weights are kept here (docs/engine.md, "The analysis process"): the config and tokenizer are
read; the engine core loads the weights it generates with, and the analysis process
(service/analysis/process.py: this process's child, or with --api-servers N the supervisor's,
shared) the copy /analyze reads. This process never touches the device (CUDA). A bad checkpoint
still stops start-up with its one-line message before serving: checked here by a lone server
before anything is spawned, reported by the analysis process to the supervisor of N.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from asgi_correlation_id import CorrelationIdMiddleware
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import Receive, Scope, Send

from model.quantized import quantize_problem
from service import routes_adapters
from service.analysis import inspection
from service.analysis import routes as analysis_routes
from service.analysis.protocol import analysis_address
from service.analysis.remote import AnalysisClient
from service.analysis.startup import analysis_models, prepare_analysis, process_config
from service.http import api, routes_chat, routes_openai, routes_tgi, routes_tokenizer
from service.http.chat_template import load_chat_template
from service.http import routes_playground
from service.http.auth import BearerAuthMiddleware
from service.http.body_limit import BodyLimitMiddleware
from service.http.client import EngineClient
from service.http.core_link import CoreLink
from service.engine.core import DEFAULT_KV_CACHE_SEQUENCES, EngineConfig
from service.engine.process import CoreProcessConfig
from service.http.drain import Drain, DrainMiddleware
from service.common.errors import install_error_handlers
from service.http.generation import Generations
from service.common.metrics import RequestMetricsMiddleware
from service.http.request_guards import FramingMiddleware, HostAllowListMiddleware
from service.http.request_context import HEADER, REQUEST_ID_OPTIONS
from service.http.sse import SERVER_SEND
from service.settings import Settings
from service.http.state import ServiceState
from weights.checkpoint import check_checkpoint, checkpoint_parameters, load_config
from weights.prepare import read_origin
from weights.tokenizer import GPT2Tokenizer

__all__ = ["ServiceState", "create_app", "load_state"]


class ServiceApp(FastAPI):
    """FastAPI, with the server's own `send` left in the scope (SERVER_SEND) before the
    middlewares wrap it: an event stream sends its body chunks there (service/http/sse.py).
    Every middleware below acts on a response's start message alone; one that must see body
    chunks too (compression, say) must not be added without taking that shortcut away."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


def load_state(settings: Settings, check_values: bool = True) -> ServiceState:
    """What the HTTP side serves from: config, tokenizer, origin; nothing of it on the device.

    A lone server checks its checkpoint first, values too, one tensor at a time on the CPU,
    keeping none: a bad one then stops start-up in one line before the engine core and the
    analysis process are spawned. One of several HTTP processes checks nothing (it would cost
    each of them start-up time): the analysis process, loading the weights, tells the
    supervisor (service/workers.py)."""
    config = load_config(settings.model_dir)
    if check_values:
        check_checkpoint(settings.model_dir, config, dtype=settings.torch_dtype)
    tokenizer = GPT2Tokenizer.from_dir(settings.model_dir)
    state = ServiceState(settings, config, tokenizer, read_origin(settings.model_dir),
                         parameters=checkpoint_parameters(settings.model_dir),
                         chat_template=load_chat_template(settings.model_dir, settings.chat_template))
    state.metrics.describe_model(
        name=settings.model_name, n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd,
        n_positions=config.n_positions, vocab_size=config.vocab_size, dtype=settings.dtype,
        device=settings.device, source=state.origin.get("source", "unknown"), quantization=settings.quantize,
    )
    return state


def core_config(settings: Settings, context_length: int, eos_token_id: int) -> CoreProcessConfig:
    """The engine core's settings: here for the core this process spawns, and in the supervisor
    for the one that several HTTP processes share (service/workers.py)."""
    engine_config = EngineConfig(
        max_slots=settings.max_batch_size,
        max_len=context_length,
        kv_cache_bytes=settings.kv_cache_bytes,
        kv_cache_fraction=settings.kv_cache_memory_fraction if settings.device == "cuda" else None,
        kv_cache_sequences=DEFAULT_KV_CACHE_SEQUENCES,
        # The HTTP side admits at most max_batch_size + max_waiting requests (429 beyond), so
        # the core's own queue never refuses one: a beam request holds several slots, so up to
        # all of them may wait.
        max_waiting=settings.max_batch_size + settings.max_waiting,
        max_prefill_tokens=settings.prefill_budget,
        prefix_caching=settings.prefix_caching,
        speculative=settings.speculation,
        static_decode=settings.cuda_graphs and settings.device == "cuda",
        decode_attention=settings.decode_attention,
        overlap={"auto": None, "on": True, "off": False}[settings.overlap],
        adapters=settings.adapters,
    )
    # Refused here, before a core is spawned: `python -m service` prints it as one line.
    problem = quantize_problem(settings.quantize, settings.device, settings.torch_dtype,
                               load_config(settings.model_dir) if settings.quantize == "int4" else None)
    if problem is not None:
        raise ValueError(problem)
    return CoreProcessConfig(
        model_dir=settings.model_dir,
        device=settings.device,
        dtype=settings.dtype,
        threads=settings.threads,
        engine=engine_config,
        eos_token_id=eos_token_id,
        quantize=settings.quantize,
    )


def build_client(state: ServiceState, link: CoreLink | None = None) -> EngineClient:
    settings = state.settings
    return EngineClient(
        core_config(settings, state.limits.context_length, state.tokenizer.eos_token_id),
        state.tokenizer,
        # Every process gets every step's stats; the first counts them (Metrics.observe_step_gauges).
        on_step=state.metrics.observe_step if link is None or link.index == 0 else state.metrics.observe_step_gauges,
        max_in_flight=settings.max_batch_size + settings.max_waiting,
        link=link,
        stream_interval=settings.stream_interval,
    )


def build_analysis(settings: Settings, link: CoreLink | None) -> AnalysisClient:
    if link is None:
        return AnalysisClient.spawning(process_config(settings))
    return AnalysisClient(analysis_address(link.run_dir.path), supervisor_pid=link.supervisor_pid)


async def start_processes(state: ServiceState, analysis: AnalysisClient) -> None:
    """The engine core and the analysis process load at the same time; if either cannot, both
    are stopped and start-up fails with its reason."""
    tasks = [asyncio.ensure_future(state.client.start()), asyncio.ensure_future(analysis.start())]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await analysis.stop()
        await state.client.stop(timeout=0, drain=False)
        raise


def include_routes(app: FastAPI) -> list[str]:
    """Mount every router; returns the route paths (the metrics' endpoint label values)."""
    routers = [api.router, routes_tgi.router, routes_openai.router, routes_chat.router, routes_tokenizer.router, analysis_routes.router,
               inspection.router, routes_adapters.router]
    for each in routers:
        app.include_router(each)
    return [route.path for each in routers for route in each.routes]


def create_app(settings: Settings, link: CoreLink | None = None) -> FastAPI:
    """`link`: one of several HTTP processes, attached to the supervisor's core (service/workers.py)."""
    # Checked before serving: a bad checkpoint must stop start-up, not the first request.
    state = load_state(settings, check_values=link is None)
    models = analysis_models(settings, state.config, check=link is None)
    state.client = build_client(state, link)
    state.generations = Generations(state.client, state.metrics, settings.retry_after_seconds)
    analysis = build_analysis(settings, link)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await start_processes(state, analysis)
        state.serving = True
        try:
            yield
        finally:
            # The server has already waited (up to drain_seconds) for open responses, and the core
            # has been draining since SIGTERM; this waits for its exit.
            await state.client.stop(timeout=settings.drain_seconds)
            await analysis.stop()

    app = ServiceApp(
        title="gpt2-serve",
        summary="GPT-2 inference: TGI- and OpenAI-compatible generation, attention spectral analysis",
        lifespan=lifespan,
    )
    app.state.service = state
    prepare_analysis(app, models, analysis)
    install_error_handlers(app)
    state.metrics.declare_endpoints(include_routes(app))
    app.include_router(routes_playground.router if settings.playground else routes_playground.disabled)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetricsMiddleware, metrics=state.metrics)
    if settings.api_key is not None:
        # Added last, so outermost: unauthenticated requests do no work and are not counted.
        app.add_middleware(BearerAuthMiddleware, api_key=settings.api_key.get_secret_value())
    # Outermost of all: refused on the headers alone, before auth and counting.
    app.state.drain = Drain()  # begun by the server on SIGTERM (service/http/server.py)
    # The engine core drains with the server, and cancels what is left a little before the server
    # gives up on open responses: those streams then end with a final event, not a cut connection.
    engine_deadline = max(0.0, settings.drain_seconds - min(1.0, settings.drain_seconds / 4))
    app.state.drain.on_begin(lambda: state.client.close(timeout=engine_deadline))
    app.add_middleware(DrainMiddleware, drain=app.state.drain, retry_after_seconds=settings.retry_after_seconds)
    if settings.allowed_hosts is not None:
        app.add_middleware(HostAllowListMiddleware, allowed_hosts=settings.allowed_hosts)
    app.add_middleware(FramingMiddleware)
    if settings.cors_origin_list:
        # Outside authentication: a browser's preflight (OPTIONS) carries no credentials.
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_origin_list, allow_methods=["GET", "POST"],
            allow_headers=["*"], expose_headers=[HEADER],
        )
    app.add_middleware(CorrelationIdMiddleware, **REQUEST_ID_OPTIONS)  # outermost: every answer carries the id
    return app
