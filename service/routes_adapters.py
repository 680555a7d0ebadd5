"""LoRA adapters loaded and unloaded at run time: vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter.

An admin route: it reads folders on the server's machine, so it is served only behind the API key
(`--api-key`); without one it answers 403. The engine core checks the folder and loads it (a bad
one is refused with its one-line reason, and nothing served changes), then the analysis process
(the spectrum of an adapter), so both serve the same names. Unloading takes effect for new
requests at once; the ones running with the adapter finish with it (service/engine/adapters.py).
Above both the HTTP side and the analysis, as service/app.py is: it speaks to both processes.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from service.analysis.startup import analysis_client
from service.common.errors import ApiError, validation_error
from service.http.state import ServiceState, service_state

router = APIRouter(prefix="/v1", tags=["LoRA adapters"])

ERRORS = {
    403: {"description": "the server has no API key: runtime adapter changes are off"},
    404: {"description": "unload: no adapter by that name"},
    422: {"description": "load: the folder is refused (its reason), or the name is taken"},
}

# Names a LoRA adapter may have: what a URL path segment and a metric label carry as they are.
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class LoadAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(pattern=ADAPTER_NAME, description="the name requests will give it (OpenAI model, TGI adapter_id)")
    lora_path: str = Field(min_length=1, max_length=4096, description="its peft folder on the server's machine")


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(pattern=ADAPTER_NAME)


def admin_only(state: ServiceState) -> None:
    if state.settings.api_key is None:
        raise ApiError(403, "forbidden", "loading adapters at run time needs an API key (--api-key): it reads "
                       "folders on the server's machine; or name them at start-up with --lora NAME=DIR")


@router.post("/load_lora_adapter", response_class=PlainTextResponse, responses=ERRORS,
             summary="Load a peft LoRA adapter folder under a name (admin: needs the API key)")
async def load_lora_adapter(body: LoadAdapterRequest, request: Request) -> PlainTextResponse:
    state = service_state(request)
    admin_only(state)
    if body.lora_name == state.settings.model_name or body.lora_name in state.adapters:
        raise validation_error(f"a model named {body.lora_name!r} is already served")
    try:
        await state.client.adapter_command(body.lora_name, body.lora_path)
    except ValueError as exc:
        raise validation_error(f"adapter {body.lora_name!r} refused: {exc}") from None
    try:
        await analysis_client(request).load_adapter(body.lora_name, body.lora_path)
    except ValueError as exc:  # the core took it: take it back, so both serve the same names
        await state.client.adapter_command(body.lora_name, None)
        raise validation_error(f"adapter {body.lora_name!r} refused by the analysis process: {exc}") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/unload_lora_adapter", response_class=PlainTextResponse, responses=ERRORS,
             summary="Unload a LoRA adapter: new requests are refused, running ones finish (admin)")
async def unload_lora_adapter(body: UnloadAdapterRequest, request: Request) -> PlainTextResponse:
    state = service_state(request)
    admin_only(state)
    if body.lora_name not in state.adapters:
        raise ApiError(404, "not_found", f"no LoRA adapter named {body.lora_name!r} is loaded")
    try:
        await state.client.adapter_command(body.lora_name, None)
    except ValueError as exc:
        raise ApiError(404, "not_found", str(exc)) from None
    await analysis_client(request).unload_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
