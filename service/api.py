"""The service's routes: TGI and OpenAI generation and the spectral analysis (own modules), plus
health, info, tokenize and metrics here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from service import routes_openai, routes_tgi
from service.analysis import routes as analysis_routes
from service.errors import error_response
from service.schemas import Info, SimpleToken, TokenizeRequest
from service.state import service_state

router = APIRouter(tags=["Service"])


def package_version() -> str:
    try:
        return version("gpt2-serve")
    except PackageNotFoundError:
        return "unknown"


@router.get("/health", summary="Liveness: the model is loaded and the engine core process is alive")
async def health(request: Request) -> Response:
    state = service_state(request)
    if state.serving and not state.client.running:
        return error_response(503, "error", "the engine core process has stopped")
    return JSONResponse({"status": "ok"})


@router.get("/info", response_model=Info, summary="The model, its weights' origin, and the limits requests must respect")
async def info(request: Request) -> dict:
    state = service_state(request)
    settings, limits, config = state.settings, state.limits, state.model.config
    stats = state.client.last_stats  # as of the engine core's last step
    return {
        "model_id": settings.model_name,
        "model_dtype": str(state.model.dtype).removeprefix("torch."),
        "model_device_type": state.model.device.type,
        "config": {
            "vocab_size": config.vocab_size, "n_positions": config.n_positions, "n_embd": config.n_embd,
            "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": config.inner_dim,
            "parameters": sum(p.numel() for p in state.model.parameters()),
        },
        "weights_origin": state.origin,
        "max_input_tokens": limits.context_length - 1,
        "max_total_tokens": limits.context_length,
        "max_new_tokens": limits.max_new_tokens,
        "max_batch_size": settings.max_batch_size,
        "max_waiting_requests": settings.max_waiting,
        "max_stop_sequences": limits.max_stop_sequences,
        "max_best_of": limits.max_sequences,
        "max_prompts_per_request": limits.max_prompts,
        "max_body_bytes": settings.max_body_bytes,
        "kv_cache": {
            "slots_used": stats.kv_slots_used if stats else 0,
            "slots_total": settings.max_batch_size,
        },
        "version": package_version(),
    }


TOKENS_PER_CHUNK = 2000  # ~130 kB of JSON: serialised in well under a GIL switch interval's worth of stalls


@router.post("/tokenize", response_model=list[SimpleToken], summary="Tokenize text as the model sees it (TGI schema)")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    tokenizer = service_state(request).tokenizer
    ids, offsets = await run_in_threadpool(tokenizer.encode_with_offsets, body.inputs)
    # 1 MB of text is ~17 MB of JSON: one json.dumps of it holds the GIL for ~0.3 s wherever it
    # runs. Built and serialised in slices instead, by a generator Starlette runs in its thread pool.
    return StreamingResponse(token_json(body.inputs, ids, offsets), media_type="application/json")


def token_json(text: str, ids: list[int], offsets: list[tuple[int, int]]) -> Iterator[bytes]:
    yield b"["
    for start in range(0, len(ids), TOKENS_PER_CHUNK):
        end = min(start + TOKENS_PER_CHUNK, len(ids))
        tokens = [{"id": ids[i], "text": text[offsets[i][0]:offsets[i][1]], "start": offsets[i][0], "stop": offsets[i][1]}
                  for i in range(start, end)]
        yield (b"," if start else b"") + json.dumps(tokens, ensure_ascii=False)[1:-1].encode()
    yield b"]"


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    return Response(service_state(request).metrics.expose(), media_type=CONTENT_TYPE_LATEST)


def include_routes(app: FastAPI) -> list[str]:
    """Mount every router; returns the route paths (the metrics' endpoint label values)."""
    routers = [router, routes_tgi.router, routes_openai.router, analysis_routes.router]
    for each in routers:
        app.include_router(each)
    return [route.path for each in routers for route in each.routes]
