"""POST /analyze/attention and /analyze/logit-lens: what the served model computes inside, for
one short text.

Bounded as /analyze/spectrum is: computed in the analysis process, never here; the same concurrency
gate (`analysis_max_concurrent`, 429 beyond); and a token limit, tighter here
(`inspect_max_tokens`) since attention maps grow as layers × heads × tokens².
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from service.analysis.figure import FigureUnavailable, check_available
from service.analysis.protocol import Attention, Lens
from service.analysis.routes import ERRORS, gated
from service.common.schemas import TokenId
from service.analysis.startup import analysis_models_of
from service.common.errors import validation_error
from service.common.state import shared_state

router = APIRouter(tags=["Analysis"])

MAX_LENS_TOP = 10


class InspectRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(None, min_length=1, max_length=100_000)
    token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=100_000)
    adapter: str | None = Field(None, max_length=200, description="a loaded LoRA adapter to apply to the model")

    @model_validator(mode="after")
    def _one_input(self) -> "InspectRequest":
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("give exactly one of text or token_ids")
        return self


class AttentionRequest(InspectRequest):
    layers: list[int] | None = Field(None, max_length=256, description="layers to return; default all")
    format: Literal["json", "svg"] = Field("json", description="svg: one heatmap per (layer, head)")


class LensRequest(InspectRequest):
    top_k: int = Field(5, ge=1, le=MAX_LENS_TOP, description="tokens per position and layer")


@router.post("/analyze/attention", responses=ERRORS, summary="Per-layer, per-head attention probabilities for a short text")
async def attention(body: AttentionRequest, request: Request) -> Response:
    n_layer = analysis_models_of(request).config.n_layer
    layers = body.layers if body.layers is not None else list(range(n_layer))
    bad = [layer for layer in layers if not 0 <= layer < n_layer]
    if bad or not layers:
        raise validation_error(f"layers must be between 0 and {n_layer - 1}; got {bad or layers}")
    if body.format == "svg":
        try:
            check_available()
        except FigureUnavailable as exc:
            raise validation_error(str(exc)) from None
    ids = await token_ids(request, body)
    return await gated(request, Attention(ids, layers, body.format, body.adapter))


@router.post("/analyze/logit-lens", responses=ERRORS, summary="The most likely next tokens read after every layer")
async def lens(body: LensRequest, request: Request) -> Response:
    ids = await token_ids(request, body)
    return await gated(request, Lens(ids, body.top_k, body.adapter))


async def token_ids(request: Request, body: InspectRequest) -> list[int]:
    """The text's tokens, checked against the model's config before anything leaves this process."""
    state, config = shared_state(request), analysis_models_of(request).config
    ids = body.token_ids if body.token_ids is not None else await run_in_threadpool(state.tokenizer.encode, body.text)
    limit = min(state.settings.inspect_max_tokens, config.n_positions)
    if not ids:
        raise validation_error("text encodes to no tokens")
    if len(ids) > limit:
        raise validation_error(f"{len(ids)} tokens given; this server inspects at most {limit}")
    bad = [t for t in ids if not 0 <= t < config.vocab_size]
    if bad:
        raise validation_error(f"token id {bad[0]} is outside the vocabulary (size {config.vocab_size})")
    return ids
