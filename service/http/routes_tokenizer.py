"""The tokenizer over HTTP: /tokenize (TGI's or vLLM's request), /detokenize and /tokenizer_info
(vLLM's shapes), so a client can check that it tokenizes as the server does.

vLLM's shapes (vllm/entrypoints/openai/protocol.py, serving_tokenization.py):
    POST /tokenize    {model?, prompt, add_special_tokens?} → {count, max_model_len, tokens, token_strs?}
    POST /detokenize  {model?, tokens}                      → {prompt}
    GET  /tokenizer_info → the tokenizer's configuration (tokenizer_config.json's keys) and
                           tokenizer_class
TGI's /tokenize ({inputs} → [{id, text, start, stop}]) is answered when the body has `inputs`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from service.common.errors import validation_error
from service.common.schemas import Text
from service.http.schemas import MAX_TEXT_CHARS, StrictRequest
from service.http.state import ServiceState, service_state
from weights.tokenizer import EOS_TEXT

router = APIRouter(tags=["Tokenizer"])

MAX_DETOKENIZE = 1_000_000  # token ids per /detokenize call


class TokenizeRequest(StrictRequest):
    inputs: Text = Field(..., min_length=1, max_length=MAX_TEXT_CHARS)
    parameters: dict[str, Any] | None = Field(None, description="accepted for TGI compatibility, ignored")


class SimpleToken(BaseModel):
    id: int
    text: str
    start: int = Field(description="character offset of the token's text in `inputs`")
    stop: int


class VLLMTokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    model: str | None = Field(None, max_length=200)
    prompt: Text = Field(..., min_length=1, max_length=MAX_TEXT_CHARS)
    # GPT-2 adds no special tokens (no BOS): both values tokenize the same.
    add_special_tokens: bool = True
    return_token_strs: bool = False


class VLLMTokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    model: str | None = Field(None, max_length=200)
    tokens: list[int] = Field(..., max_length=MAX_DETOKENIZE)


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


TOKENS_PER_CHUNK = 2000  # ~130 kB of JSON: serialised in well under a GIL switch interval's worth of stalls


def tgi_token_json(text: str, ids: list[int], offsets: list[tuple[int, int]]) -> Iterator[bytes]:
    yield b"["
    for start in range(0, len(ids), TOKENS_PER_CHUNK):
        end = min(start + TOKENS_PER_CHUNK, len(ids))
        tokens = [{"id": ids[i], "text": text[offsets[i][0]:offsets[i][1]], "start": offsets[i][0], "stop": offsets[i][1]}
                  for i in range(start, end)]
        yield (b"," if start else b"") + json.dumps(tokens, ensure_ascii=False)[1:-1].encode()
    yield b"]"


def check_model(state: ServiceState, model: str | None) -> None:
    if model is not None and model != state.settings.model_name:
        raise validation_error(f"model {model!r} is not served here; this server serves {state.settings.model_name!r}")


@router.post(
    "/tokenize",
    response_model=list[SimpleToken] | VLLMTokenizeResponse,
    summary="Tokenize text as the model sees it: TGI's {inputs} or vLLM's {prompt} request",
)
async def tokenize(body: TokenizeRequest | VLLMTokenizeRequest, request: Request) -> Response | dict:
    state = service_state(request)
    text = body.inputs if isinstance(body, TokenizeRequest) else body.prompt
    ids, offsets = await run_in_threadpool(state.tokenizer.encode_with_offsets, text)
    if isinstance(body, TokenizeRequest):
        # 1 MB of text is ~17 MB of JSON: one json.dumps of it holds the GIL for ~0.3 s wherever it
        # runs. Built and serialised in slices instead, by a generator Starlette runs in its thread pool.
        return StreamingResponse(tgi_token_json(text, ids, offsets), media_type="application/json")
    check_model(state, body.model)
    out = {"count": len(ids), "max_model_len": state.limits.context_length, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [state.tokenizer.token_str(t) for t in ids]
    return out


@router.post("/detokenize", response_model=DetokenizeResponse, summary="Token ids to text (vLLM's schema)")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state = service_state(request)
    check_model(state, body.model)
    bad = [t for t in body.tokens if not 0 <= t < state.limits.vocab_size]
    if bad:
        raise validation_error(f"token id {bad[0]} is outside the vocabulary (0 to {state.limits.vocab_size - 1})")
    return {"prompt": await run_in_threadpool(state.tokenizer.decode, body.tokens)}


@router.get("/tokenizer_info", response_model=TokenizerInfo, summary="The tokenizer's configuration (vLLM's schema)")
async def tokenizer_info(request: Request) -> dict:
    state = service_state(request)
    # What transformers' GPT-2 tokenizer reports (its init_kwargs, as vLLM returns them), with the
    # context this server allows as model_max_length. "GPT2Tokenizer": transformers 5's name for
    # the tokenizers-backed class, which AutoTokenizer in transformers 4 also maps to its fast one.
    return {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": EOS_TEXT,
        "eos_token": EOS_TEXT,
        "unk_token": EOS_TEXT,
        "errors": "replace",
        "model_max_length": state.limits.context_length,
        "vocab_size": state.tokenizer.vocab_size,
        "eos_token_id": state.tokenizer.eos_token_id,
    }
