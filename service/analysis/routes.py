"""GET/POST /analyze/spectrum: the attention spectral analysis (docs/analysis.md) on the served
model, and on the analysis-only comparison model when the server loaded one (--compare-model-dir).
`adapter` names a LoRA adapter to apply (--lora, or loaded at run time; unknown: 404), and
`compare=base` sets the fine-tuned model beside its base. GET /analyze/adapters lists them.

An analysis runs in the analysis process (service/analysis/process.py), never in an HTTP
process, and at most `analysis_max_concurrent` run at once: one more is answered 429
(overloaded, Retry-After) at once rather than queued, so analyses never pile up behind each
other while generation shares the device. Texts are limited in number (`analysis_max_texts`)
and length (`analysis_max_tokens`, default and at most each model's context): beyond, 422 naming
the text and the limit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from model.analysis import check_layers
from service.analysis.figure import SVG_MEDIA_TYPE, FigureUnavailable, check_available
from service.analysis.protocol import Done, Refused, Spectrum
from service.analysis.remote import AnalysisUnavailable
from service.analysis.startup import analysis_client, analysis_models_of
from service.common.errors import ApiError, overloaded_error, validation_error
from service.common.schemas import Text, TokenId
from service.common.state import shared_state

router = APIRouter(tags=["Analysis"])

Method = Literal["exact", "fast"]
Format = Literal["json", "svg"]
# true/false: the comparison model or not; "base": the served model without the adapter.
Compare = bool | Literal["base"] | None
COMPARE_HELP = (
    "true: also the server's comparison model (default: when it has one); "
    "base: also the served model without the adapter, beside it"
)
ENDPOINT = "/analyze/spectrum"
ERRORS = {
    404: {"description": "no LoRA adapter of that name is loaded: {error, error_type: not_found}"},
    422: {"description": "invalid input: {error, error_type: validation}"},
    429: {"description": "analyses already running: {error, error_type: overloaded}, Retry-After"},
    503: {"description": "the analysis process has stopped: {error, error_type: unavailable}"},
}
RESPONSES = {200: {"content": {SVG_MEDIA_TYPE: {}}, "description": "the report (JSON) or its figure (SVG)"}, **ERRORS}


class SpectrumRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    texts: list[Text] | None = Field(None, min_length=1, description="texts to analyse, each on its own")
    token_ids: list[list[TokenId]] | None = Field(None, min_length=1, description="or token id sequences")
    method: Method = Field("fast", description="exact: LAPACK svdvals; fast: block Krylov, 1e-4 relative")
    layers: list[int] | None = Field(None, description="layers whose attention to measure; default all")
    format: Format = Field("json", description="json: the report; svg: its figure")
    compare: Compare = Field(None, description=COMPARE_HELP)
    adapter: str | None = Field(None, max_length=200, description="a loaded LoRA adapter to apply to the model")

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
    compare: Compare = Query(None, description=COMPARE_HELP),
    adapter: str | None = Query(None, max_length=200, description="a loaded LoRA adapter to apply to the model"),
) -> Response:
    return await _spectrum(request, text, None, method, _parse_layers(layers), format, compare, adapter)


@router.post(ENDPOINT, responses=RESPONSES, summary="Spectral norms of the attention matrices for texts or token ids")
async def spectrum_post(body: SpectrumRequest, request: Request) -> Response:
    return await _spectrum(
        request, body.texts, body.token_ids, body.method, body.layers, body.format, body.compare, body.adapter
    )


@router.get("/analyze/adapters", responses={503: ERRORS[503]}, summary="The LoRA adapters an analysis may apply")
async def adapters(request: Request) -> dict:
    try:
        return {"adapters": await analysis_client(request).adapters()}
    except AnalysisUnavailable as exc:
        raise ApiError(503, "unavailable", str(exc)) from None


async def _spectrum(
    request: Request,
    texts: list[str] | None,
    token_ids: list[list[int]] | None,
    method: str,
    layers: list[int] | None,
    format: str,
    compare: bool | str | None,
    adapter: str | None,
) -> Response:
    state = shared_state(request)
    settings = state.settings
    count = len(texts if texts is not None else token_ids)
    if count > settings.analysis_max_texts:
        raise validation_error(
            f"{count} texts given; this server analyses at most {settings.analysis_max_texts} per request"
        )
    models = analysis_models_of(request)
    compare_base = compare == "base"
    if compare_base and adapter is None:
        raise validation_error("compare=base compares an adapter with its base; name one with adapter=NAME")
    if compare is True and models.compare is None:
        raise validation_error("compare=true, but this server has no comparison model (start it with --compare-model-dir)")
    with_compare = compare is True or (compare is None and models.compare is not None)
    # What the configs can refuse is refused here; the tokens (each model's own tokenizer), their
    # limits and the adapter's name are checked by the analysis process, under the gate.
    with _invalid_is_422():
        for config in (models.config, models.compare) if with_compare else (models.config,):
            check_layers(config, layers)
        if format == "svg":
            check_available()
    return await gated(request, Spectrum(texts, token_ids, method, layers, format, with_compare, adapter, compare_base))


async def gated(request: Request, call) -> Response:
    """Send the call to the analysis process under the analyses' shared concurrency gate (429
    when full); this process waits on its event loop, computing nothing."""
    state = shared_state(request)
    settings = state.settings
    gate = analysis_gate(request, settings.analysis_max_concurrent)
    if not gate.acquire(blocking=False):
        raise overloaded_error(
            f"{settings.analysis_max_concurrent} analyses are already running; retry later",
            settings.retry_after_seconds,
        )
    try:
        answer = await analysis_client(request).call(call)
    except AnalysisUnavailable as exc:
        raise ApiError(503, "unavailable", str(exc)) from None
    finally:
        gate.release()
    if isinstance(answer, Done):
        state.metrics.analysis_duration.observe(answer.seconds)
        state.metrics.count_fast_matrices(answer.fast_iterated, answer.fast_fallbacks)
        return Response(answer.body, media_type=answer.media_type)
    if isinstance(answer, Refused) and answer.kind == "validation":
        raise validation_error(answer.message)
    if isinstance(answer, Refused) and answer.kind == "not_found":
        raise ApiError(404, "not_found", answer.message)
    if isinstance(answer, Refused):
        raise overloaded_error(answer.message, settings.retry_after_seconds)
    raise ApiError(500, "error", answer.message)


@contextmanager
def _invalid_is_422() -> Iterator[None]:
    try:
        yield
    except (ValueError, FigureUnavailable) as exc:
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


def analysis_gate(request: Request, limit: int) -> threading.BoundedSemaphore:
    """The app's analysis semaphore, made on first use (one per app, shared by its requests)."""
    app_state = request.app.state
    with _gate_lock:
        gate = getattr(app_state, "analysis_gate", None)
        if gate is None:
            gate = app_state.analysis_gate = threading.BoundedSemaphore(limit)
        return gate
