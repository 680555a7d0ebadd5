"""POST /analyze/attention and /analyze/logit-lens: what the served model computes inside, for
one short text.

Bounded as /analyze/spectrum is: a worker thread, never the event loop; the same concurrency
gate (`analysis_max_concurrent`, 429 beyond); and a token limit, tighter here
(`inspect_max_tokens`) since attention maps grow as layers × heads × tokens².
"""

from __future__ import annotations

import io
import time
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from matplotlib.figure import Figure
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from model.introspect import attention_maps, logit_lens
from service.analysis.figure import SVG_MEDIA_TYPE
from service.analysis.routes import ERRORS, analysis_gate
from service.common.errors import overloaded_error, validation_error
from service.common.state import SharedState, shared_state

router = APIRouter(tags=["Analysis"])

MAX_LENS_TOP = 10


class InspectRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(None, min_length=1, max_length=100_000)
    token_ids: list[int] | None = Field(None, min_length=1, max_length=100_000)

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
    state = shared_state(request)
    n_layer = state.model.config.n_layer
    layers = body.layers if body.layers is not None else list(range(n_layer))
    bad = [layer for layer in layers if not 0 <= layer < n_layer]
    if bad or not layers:
        raise validation_error(f"layers must be between 0 and {n_layer - 1}; got {bad or layers}")
    ids = await token_ids(state, body)
    maps = await gated(request, state, attention_maps, state.model, ids, layers)  # [layers, H, T, T]
    tokens = [state.tokenizer.decode([t]) for t in ids]
    if body.format == "svg":
        svg = await run_in_threadpool(heatmaps_svg, maps, layers, tokens)
        return Response(svg, media_type=SVG_MEDIA_TYPE)
    return JSONResponse({
        "model": state.settings.model_name, "token_ids": ids, "tokens": tokens,
        # attention[layer][head][query][key]
        "layers": [{"layer": layer, "attention": maps[i].tolist()} for i, layer in enumerate(layers)],
    })


@router.post("/analyze/logit-lens", responses=ERRORS, summary="The most likely next tokens read after every layer")
async def lens(body: LensRequest, request: Request) -> Response:
    state = shared_state(request)
    ids = await token_ids(state, body)
    top = await gated(request, state, logit_lens, state.model, ids, body.top_k)
    decode = state.tokenizer.decode
    layers = []
    for depth in range(top.ids.shape[0]):
        positions = [
            [{"id": int(t), "text": decode([int(t)]), "logprob": float(lp)}
             for t, lp in zip(top.ids[depth, position], top.logprobs[depth, position])]
            for position in range(len(ids))
        ]
        # 0: the embeddings; i: after block i (the last is the model's output).
        layers.append({"layer": depth, "top": positions})
    return JSONResponse({"model": state.settings.model_name, "token_ids": ids,
                         "tokens": [decode([t]) for t in ids], "layers": layers})


async def token_ids(state: SharedState, body: InspectRequest) -> list[int]:
    ids = body.token_ids if body.token_ids is not None else await run_in_threadpool(state.tokenizer.encode, body.text)
    limit = min(state.settings.inspect_max_tokens, state.model.config.n_positions)
    if not ids:
        raise validation_error("text encodes to no tokens")
    if len(ids) > limit:
        raise validation_error(f"{len(ids)} tokens given; this server inspects at most {limit}")
    bad = [t for t in ids if not 0 <= t < state.model.config.vocab_size]
    if bad:
        raise validation_error(f"token id {bad[0]} is outside the vocabulary (size {state.model.config.vocab_size})")
    return ids


async def gated(request: Request, state: SharedState, fn, *args):
    """Run fn in a worker thread under the analyses' shared concurrency gate (429 when full)."""
    settings = state.settings
    gate = analysis_gate(request, settings.analysis_max_concurrent)
    if not gate.acquire(blocking=False):
        raise overloaded_error(
            f"{settings.analysis_max_concurrent} analyses are already running; retry later", settings.retry_after_seconds
        )
    try:
        started = time.perf_counter()
        result = await run_in_threadpool(fn, *args)
        state.metrics.analysis_duration.observe(time.perf_counter() - started)
        return result
    finally:
        gate.release()


def heatmaps_svg(maps, layers: list[int], tokens: list[str]) -> str:
    """A grid of heatmaps: one row per layer, one column per head (query down, key across)."""
    n_layers, n_heads = maps.shape[:2]
    figure = Figure(figsize=(1.6 * n_heads + 1, 1.6 * n_layers + 0.5), layout="constrained")
    grid = figure.subplots(n_layers, n_heads, squeeze=False)
    for i, layer in enumerate(layers):
        for head in range(n_heads):
            axes = grid[i][head]
            image = axes.imshow(maps[i, head].numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
            axes.set_xticks([])
            axes.set_yticks([])
            axes.set_title(f"L{layer} H{head}", fontsize=7)
    figure.colorbar(image, ax=grid, shrink=0.6, label="attention probability")
    figure.suptitle(f"attention over {len(tokens)} tokens")
    out = io.StringIO()
    figure.savefig(out, format="svg")
    return out.getvalue()
