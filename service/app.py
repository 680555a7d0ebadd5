"""Builds the FastAPI application: loads the model, builds the engine loop, mounts the routes.

Request path: Framing (400: CL+TE) → HostAllowList (400, optional) → Drain (503 after SIGTERM)
→ BearerAuth (optional) → RequestMetrics → BodyLimit (413 before parsing)
→ route → schemas/admission (422) → Generations → EngineLoop (its own thread) → back as events.
"""

from __future__ import annotations

import threading
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI

from model.analysis import cached_weight_spectra

from service.api import include_routes
from service.auth import BearerAuthMiddleware
from service.body_limit import BodyLimitMiddleware
from service.drain import Drain, DrainMiddleware
from service.engine import Engine, EngineConfig
from service.errors import install_error_handlers
from service.generation import Generations
from service.loop import EngineLoop
from service.metrics import RequestMetricsMiddleware
from service.request_guards import FramingMiddleware, HostAllowListMiddleware
from service.settings import Settings
from service.state import ServiceState
from weights.checkpoint import load_model
from weights.prepare import read_origin
from weights.tokenizer import GPT2Tokenizer

__all__ = ["ServiceState", "create_app", "load_state"]


def load_state(settings: Settings) -> ServiceState:
    if settings.threads:
        torch.set_num_threads(settings.threads)
    model = load_model(settings.model_dir, device=settings.device, dtype=settings.torch_dtype)
    tokenizer = GPT2Tokenizer.from_dir(settings.model_dir)
    state = ServiceState(settings, model, tokenizer, read_origin(settings.model_dir))
    config = model.config
    state.metrics.describe_model(
        name=settings.model_name, n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd,
        n_positions=config.n_positions, vocab_size=config.vocab_size, dtype=settings.dtype,
        device=settings.device, source=state.origin.get("source", "unknown"),
    )
    return state


def build_loop(state: ServiceState) -> EngineLoop:
    settings = state.settings
    engine_config = EngineConfig(
        max_slots=settings.max_batch_size,
        max_len=state.limits.context_length,
        max_waiting=settings.max_waiting,
        max_prefill_tokens=settings.max_prefill_tokens,
    )
    engine = Engine(state.model, state.tokenizer, engine_config)
    return EngineLoop(engine, on_step=state.metrics.observe_step)


def create_app(settings: Settings) -> FastAPI:
    # Load before serving: a bad checkpoint must stop start-up, not the first request.
    state = load_state(settings)
    state.loop = build_loop(state)
    state.generations = Generations(state.loop, state.metrics, settings.retry_after_seconds)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start()
        # Weight spectra depend on the weights only: compute them once now, off the request path,
        # so the first /analyze/spectrum does not pay for them (seconds on the larger models).
        threading.Thread(target=cached_weight_spectra, args=(state.model,), daemon=True).start()
        state.serving = True
        try:
            yield
        finally:
            # uvicorn has already waited (up to drain_seconds) for open responses; what is still
            # running now finishes or is cancelled by the loop's own drain.
            await state.loop.stop(timeout=settings.drain_seconds)

    app = FastAPI(
        title="gpt2-serve",
        summary="GPT-2 inference: TGI- and OpenAI-compatible generation, attention spectral analysis",
        lifespan=lifespan,
    )
    app.state.service = state
    install_error_handlers(app)
    state.metrics.declare_endpoints(include_routes(app))
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetricsMiddleware, metrics=state.metrics)
    if settings.api_key is not None:
        # Added last, so outermost: unauthenticated requests do no work and are not counted.
        app.add_middleware(BearerAuthMiddleware, api_key=settings.api_key.get_secret_value())
    # Outermost of all: refused on the headers alone, before auth and counting.
    app.state.drain = Drain()  # begun by the server on SIGTERM (service/http_server.py)
    app.add_middleware(DrainMiddleware, drain=app.state.drain, retry_after_seconds=settings.retry_after_seconds)
    if settings.allowed_hosts is not None:
        app.add_middleware(HostAllowListMiddleware, allowed_hosts=settings.allowed_hosts)
    app.add_middleware(FramingMiddleware)
    return app
