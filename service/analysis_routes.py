"""GET/POST /analyze/spectrum: the attention spectral analysis of ANALYSIS.md on the served model.

An analysis runs in a worker thread, never on the event loop, and at most
`analysis_max_concurrent` run at once: one more is answered 429 (overloaded, Retry-After) at
once rather than queued, so analyses never pile up behind each other while generation shares the
CPU. Texts are limited in number (`analysis_max_texts`) and length (`analysis_max_tokens`, and
the model's context): beyond, 422 naming the text and the limit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from model.analysis import analyze, check_layers, check_sequences
from service.analysis_figure import SVG_MEDIA_TYPE, render_svg
from service.errors import overloaded_error, validation_error
from service.schemas import Text
from service.state import ServiceState, service_state

router = APIRouter(tags=["Analysis"])

Method = Literal["exact", "fast"]
Format = Literal["json", "svg"]
ENDPOINT = "/analyze/spectrum"
ERRORS = {
    422: {"description": "invalid input: {error, error_type: validation}"},
    429: {"description": "analyses already running: {error, error_type: overloaded}, Retry-After"},
}
RESPONSES = {200: {"content": {SVG_MEDIA_TYPE: {}}, "description": "the report (JSON) or its figure (SVG)"}, **ERRORS}


class SpectrumRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    texts: list[Text] | None = Field(None, min_length=1, description="texts to analyse, each on its own")
    token_ids: list[list[int]] | None = Field(None, min_length=1, description="or token id sequences")
    method: Method = Field("fast", description="exact: LAPACK svdvals; fast: block Krylov, 1e-4 relative")
    layers: list[int] | None = Field(None, description="layers whose attention to measure; default all")
    format: Format = Field("json", description="json: the report; svg: its figure")

    @model_validator(mode="after")
    def _one_input(self) -> "SpectrumRequest":
        if (self.texts is None) == (self.token_ids is None):
            raise ValueError("give exactly one of texts or token_ids")
        return self


@router.get(ENDPOINT, responses=RESPONSES, summary="Spectral norms of the attention matrices for texts")
async def spectrum_get(
    request: Request,
    text: list[Text] = Query(..., description="a text to analyse; repeat for several"),
    method: Method = Query("fast"),
    layers: list[str] | None = Query(None, description="layer indices, repeated or comma-separated"),
    format: Format = Query("json"),
) -> Response:
    return await _spectrum(request, text, None, method, _parse_layers(layers), format)


@router.post(ENDPOINT, responses=RESPONSES, summary="Spectral norms of the attention matrices for texts or token ids")
async def spectrum_post(body: SpectrumRequest, request: Request) -> Response:
    return await _spectrum(request, body.texts, body.token_ids, body.method, body.layers, body.format)


async def _spectrum(
    request: Request,
    texts: list[str] | None,
    token_ids: list[list[int]] | None,
    method: str,
    layers: list[int] | None,
    format: str,
) -> Response:
    state = service_state(request)
    settings = state.settings
    count = len(texts if texts is not None else token_ids)
    if count > settings.analysis_max_texts:
        raise validation_error(
            f"{count} texts given; this server analyses at most {settings.analysis_max_texts} per request"
        )
    config = state.model.config
    with _invalid_is_422():
        check_layers(config, layers)
    gate = _gate(request, settings.analysis_max_concurrent)
    if not gate.acquire(blocking=False):
        raise overloaded_error(
            f"{settings.analysis_max_concurrent} analyses are already running; retry later",
            settings.retry_after_seconds,
        )
    try:
        if token_ids is None:
            token_ids = await run_in_threadpool(state.tokenizer.encode_batch, texts)
        with _invalid_is_422():
            what = "text" if texts is not None else "token_ids"
            check_sequences(config, token_ids, settings.analysis_max_tokens, what)
        started = time.perf_counter()
        body = await run_in_threadpool(_run, state, token_ids, method, layers, format)
        state.metrics.analysis_duration.observe(time.perf_counter() - started)
    finally:
        gate.release()
    if format == "svg":
        return Response(body, media_type=SVG_MEDIA_TYPE)
    return JSONResponse(body)


def _run(state: ServiceState, token_ids: list[list[int]], method: str, layers: list[int] | None, format: str):
    report = report_dict(state.model, state.settings.model_name, token_ids, method, layers)
    return render_svg(report) if format == "svg" else report


def report_dict(model, model_name: str, token_ids: list[list[int]], method: str, layers: list[int] | None) -> dict:
    """The JSON body: the model's identity, then the report (shared with the command line)."""
    config = model.config
    described = {
        "name": model_name, "n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd,
        "dtype": str(model.dtype).removeprefix("torch."),
    }
    return {"model": described} | analyze(model, token_ids, method, layers).to_dict()


@contextmanager
def _invalid_is_422() -> Iterator[None]:
    try:
        yield
    except ValueError as exc:
        raise validation_error(str(exc)) from None


def _parse_layers(values: list[str] | None) -> list[int] | None:
    if values is None:
        return None
    parts = [part.strip() for value in values for part in value.split(",") if part.strip()]
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise validation_error(f"layers must be integers, got {values}") from None


_gate_lock = threading.Lock()


def _gate(request: Request, limit: int) -> threading.BoundedSemaphore:
    """The app's analysis semaphore, made on first use (one per app, shared by its requests)."""
    app_state = request.app.state
    with _gate_lock:
        gate = getattr(app_state, "analysis_gate", None)
        if gate is None:
            gate = app_state.analysis_gate = threading.BoundedSemaphore(limit)
        return gate
