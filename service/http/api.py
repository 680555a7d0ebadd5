"""Health, info and metrics. The other routes have their own modules (service/http/routes_*.py,
service/analysis/); service/app.py mounts them all."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from model.quantized import QUANTIZE_METHODS
from service.common.errors import error_response
from service.http.grammar import KINDS as GRAMMAR_KINDS
from service.http.state import service_state

router = APIRouter(tags=["Service"])


class Info(BaseModel):
    model_id: str
    model_dtype: str
    model_device_type: str
    config: dict = Field(description="the GPT-2 hyper-parameters")
    weights_origin: dict
    quantization: dict = Field(
        description="mode (--quantize); the weights generation runs on (engine core) and those the /analyze routes"
        " read (always the float ones); method (null: none)"
    )
    max_input_tokens: int
    max_total_tokens: int
    max_new_tokens: int
    max_batch_size: int
    max_waiting_requests: int
    max_stop_sequences: int
    max_best_of: int
    max_prompts_per_request: int
    max_body_bytes: int
    kv_cache: dict = Field(description="slots used and total right now, and whether prompts reuse cached prefixes")
    max_prefill_tokens_per_step: int = Field(description="prompt tokens one engine step prefills; longer prompts go in chunks")
    speculative_decoding: dict = Field(description="n-gram drafts: method (null: off), n-gram sizes, the most tokens drafted per step, rows per weight pass (how drafts are priced)")
    grammar: dict = Field(description="constrained decoding: the grammar engine and the kinds of grammar served (json, regex, choice, grammar)")
    version: str

    model_config = ConfigDict(protected_namespaces=())


def package_version(package: str = "gpt2-serve") -> str:
    try:
        return version(package)
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
    settings, limits, config = state.settings, state.limits, state.config
    stats = state.client.last_stats  # as of the engine core's last step
    return {
        "model_id": settings.model_name,
        # The settings', as the engine core and the analysis process load it: this process has no weights.
        "model_dtype": settings.dtype,
        "model_device_type": settings.device,
        "config": {
            "vocab_size": config.vocab_size, "n_positions": config.n_positions, "n_embd": config.n_embd,
            "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": config.inner_dim,
            "parameters": state.parameters,
        },
        "weights_origin": state.origin,
        "quantization": {
            "mode": settings.quantize,
            # Generation runs in the engine core on its own copy; /analyze on the analysis process's float one.
            "generation_weights": settings.quantize if settings.quantize != "none" else settings.dtype,
            "analysis_weights": settings.dtype,
            "method": QUANTIZE_METHODS.get(settings.quantize),
        },
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
            "prefix_caching": settings.prefix_caching,
        },
        "max_prefill_tokens_per_step": settings.prefill_budget,
        "speculative_decoding": {
            "method": "ngram" if settings.speculative_ngram else None,
            "ngram_min": settings.speculative_ngram_min,
            "ngram_max": settings.speculative_ngram_max,
            "tokens": settings.speculative_tokens,
            "weight_pass_rows": settings.weight_pass_rows,
        },
        "grammar": {"engine": f"llguidance {package_version('llguidance')}", "kinds": list(GRAMMAR_KINDS)},
        "version": package_version(),
    }


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    return Response(service_state(request).metrics.expose(), media_type=CONTENT_TYPE_LATEST)
