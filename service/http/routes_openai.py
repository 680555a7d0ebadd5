"""OpenAI's legacy completions API: POST /v1/completions (with stream), GET /v1/models.

The official `openai` client works unchanged (base_url=http://host:port/v1). Choice i*n + j is
the j-th completion of prompt i, as OpenAI numbers them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from service.http.admission import (
    Prompt,
    check_count,
    check_lengths,
    generation_requests,
    new_request_id,
    openai_sampling,
    prompts_from_ids,
    tokenize_off_loop,
)
from service.common.errors import ApiError, error_body
from service.http.generation import CallStreams
from service.http.grammar import openai_grammar
from service.common.metrics import set_outcome
from service.engine.types import FinishedRequest, FinishedSequence, GenerationRequest, TokenEvent
from service.http.routes_tgi import CLIENT_GONE, ERRORS
from service.http.scoring import completion_logprobs, vllm_prompt_logprobs
from service.http.schemas_openai import CompletionRequest, CompletionResponse, ModelCard, ModelList
from service.http.body_writer import body_writer
from service.http.sse import DONE, SERVER_SEND, EventStream, encode_json, json_string, sse
from service.http.state import ServiceState, service_state
from weights.tokenizer import GPT2Tokenizer

router = APIRouter(prefix="/v1", tags=["OpenAI"])


@router.get("/models", response_model=ModelList, summary="The base model and each LoRA adapter served")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": model_cards(service_state(request))}


@router.get("/models/{model_id:path}", response_model=ModelCard, summary="One model served (the base, or a LoRA adapter)")
async def retrieve_model(model_id: str, request: Request) -> dict:
    state = service_state(request)
    state.served_adapter(model_id)  # 404 naming what is served
    return next(card for card in model_cards(state) if card["id"] == model_id)


def model_cards(state: ServiceState) -> list[dict]:
    base = state.settings.model_name
    card = {"id": base, "object": "model", "created": int(state.started_at), "owned_by": "gpt2-serve"}
    # Each LoRA adapter as a model of its own, as vLLM lists them: its parent is the base.
    return [card, *({**card, "id": name, "parent": base} for name in state.adapters)]


@router.post(
    "/completions",
    response_model=CompletionResponse,
    responses={200: {"content": {"text/event-stream": {}}}, **ERRORS},
    summary="Complete prompts (OpenAI completions schema); stream=true for server-sent events",
)
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = service_state(request)
    call = await admit(state, body)
    return await answer(state, call, request, lambda batch: stream_chunks(state, call, batch, request),
                        lambda results: completion_body(call, results, state.tokenizer))


async def answer(
    state: ServiceState, call: "Call", request: Request,
    chunks: Callable[[CallStreams], AsyncIterator[bytes]], whole: Callable[[list[FinishedRequest]], dict],
) -> Response:
    """Run an admitted call: streamed (`chunks` of its events) or whole (`whole` of its results)."""
    if call.body.stream:
        batch = state.generations.submit(call.requests)
        return EventStream(chunks(batch), on_close=lambda: state.generations.end(batch, request))
    results = await state.generations.complete(call.requests, request)
    if results is None:
        return Response(status_code=CLIENT_GONE)
    return JSONResponse(whole(results))


class Call:
    """One /v1/completions call: its prompts, engine requests and how they map to choices."""

    def __init__(self, body: CompletionRequest, prompts: list[Prompt], requests: list[GenerationRequest], model: str,
                 prefix: str = "cmpl"):
        self.body = body
        self.prompts = prompts
        self.requests = requests
        self.model = model
        self.id = new_request_id(prefix)
        self.created = int(time.time())
        # Greedy n > 1 submits each prompt n times; sampling submits it once with n sequences.
        self.copies = len(requests) // len(prompts)
        self._event_head: str | None = None

    def prompt_of(self, request_index: int) -> Prompt:
        return self.prompts[request_index // self.copies]

    def choice_index(self, request_index: int, sequence_index: int) -> int:
        return request_index * (self.body.n // self.copies) + sequence_index

    def usage(self, completion_tokens: int) -> dict:
        prompt_tokens = sum(len(p.ids) for p in self.prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def text_event(self, index: int, event: TokenEvent) -> bytes:
        """sse(self.chunk([{index, text, logprobs: None, finish_reason: None}])) of the event's
        text for choice `index`, the event sent per token, written directly: what every event of
        the call shares is encoded once."""
        if self._event_head is None:
            self._event_head = "data: " + encode_json(self.chunk([]))[: -len("]}")]
        return (f'{self._event_head}{{"index": {index}, "text": {json_string(event.text)}, "logprobs": null, '
                f'"finish_reason": null}}]}}\n\n').encode()


async def admit(state: ServiceState, body: CompletionRequest, prefix: str = "cmpl") -> Call:
    """The one admission of /v1/completions and /v1/chat/completions (`prefix` "chatcmpl": the
    chat route's, whose prompt is its rendered conversation's token ids)."""
    limits = state.limits
    adapter = state.served_adapter(body.model)  # the base model's name, or a LoRA adapter's
    grammar = openai_grammar(body)
    params = openai_sampling(body, limits, grammar)
    await state.grammars.check(grammar)  # compiled with its first masks, off the event loop
    entries = body.prompt_list
    check_count("the number of prompts", len(entries), limits.max_prompts)
    # The schema admits all strings or all token-id lists, never a mix.
    if isinstance(entries[0], str):
        prompts = await tokenize_off_loop(state.tokenizer, entries)
    else:
        prompts = prompts_from_ids(state.tokenizer, entries, limits)
    check_lengths(prompts, params.max_new_tokens, limits)
    copies = body.n if params.num_return_sequences == 1 else 1
    requests = generation_requests([p for p in prompts for _ in range(copies)], params, prefix, adapter)
    return Call(body, prompts, requests, body.model, prefix)


# --- whole answers -------------------------------------------------------------------------------


def completion_body(call: Call, results: list[FinishedRequest], tokenizer: GPT2Tokenizer) -> dict:
    body, choices = call.body, []
    for request_index, result in enumerate(results):
        prompt = call.prompt_of(request_index)
        sequences = result.sequences
        if len(sequences) > body.n:
            # best_of: keep the n with the highest mean log-probability per token, as OpenAI.
            sequences = sorted(sequences, key=mean_logprob, reverse=True)[: body.n]
        for sequence_index, seq in enumerate(sequences):
            choices.append(choice(call, request_index, sequence_index, prompt, result, seq, tokenizer))
    # max_tokens=0 ran one token that the answer leaves out (openai_max_new_tokens).
    usage = call.usage(0 if body.max_tokens == 0 else sum(r.generated_tokens for r in results))
    return call.chunk(sorted(choices, key=lambda c: c["index"]), usage)


def choice(
    call: Call, request_index: int, sequence_index: int, prompt: Prompt, result: FinishedRequest,
    seq: FinishedSequence, tokenizer: GPT2Tokenizer,
) -> dict:
    body = call.body
    scoring_only = body.max_tokens == 0
    ids, lps = ([], []) if scoring_only else (list(seq.token_ids), list(seq.logprobs))
    tops: list = list(seq.top_logprobs or [None] * len(ids)) if not scoring_only else []
    text = (prompt.text if body.echo else "") + ("" if scoring_only else seq.text)
    logprobs = None
    if body.logprobs is not None:
        if body.echo:
            scores = result.prompt_scores
            ids = prompt.ids + ids
            lps = list(scores.logprobs if scores else [None] * len(prompt.ids)) + lps
            tops = list(scores.top if scores else [None] * len(prompt.ids)) + tops
        logprobs = completion_logprobs(ids, lps, tops, body.logprobs, 0, tokenizer)
    out = {
        "index": call.choice_index(request_index, sequence_index),
        "text": text,
        "logprobs": logprobs,
        "finish_reason": "length" if scoring_only else openai_finish_reason(seq.finish_reason),
    }
    if body.prompt_logprobs is not None and result.prompt_scores is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(prompt.ids, result.prompt_scores, body.prompt_logprobs, tokenizer)
    return out


def mean_logprob(seq: FinishedSequence) -> float:
    return sum(seq.logprobs) / max(len(seq.logprobs), 1)


def openai_finish_reason(reason: str) -> str:
    return "length" if reason in ("length", "cancelled") else "stop"


# --- streaming -----------------------------------------------------------------------------------


async def stream_chunks(state: ServiceState, call: Call, batch: CallStreams, request: Request) -> AsyncIterator[bytes]:
    body, tokenizer = call.body, state.tokenizer
    offsets: dict[int, int] = {}  # choice index → characters sent so far (text_offset)
    generated = 0
    so_far = 0  # tokens streamed, for vLLM's continuous_usage_stats
    # The core reader may write the per-token text events itself (service/http/body_writer.py):
    # when they are plain (no logprobs, so no offsets to keep) and the call has one sequence (more
    # would each be a write, where the stream writes what a step brings a call at once).
    options = body.stream_options
    continuous = options is not None and options.continuous_usage_stats
    plain = body.logprobs is None and len(call.requests) == 1 and body.n == 1 and not continuous
    writer = body_writer(request.scope.get(SERVER_SEND)) if plain else None
    # Its one choice is choice 0.
    direct = writer.token_sink(partial(call.text_event, 0)) if writer is not None else None
    try:
        if body.echo:
            for request_index in range(len(call.requests)):
                prompt = call.prompt_of(request_index)
                for sequence_index in range(body.n // call.copies):
                    index = call.choice_index(request_index, sequence_index)
                    offsets[index] = len(prompt.text)
                    yield sse(call.chunk([{"index": index, "text": prompt.text, "logprobs": None, "finish_reason": None}],
                                         call.usage(0) if continuous else None))
        async for arrived in state.generations.events(batch, request, direct):
            chunk = []
            for request_index, items in arrived:
                for item in items:
                    if isinstance(item, TokenEvent):
                        index = call.choice_index(request_index, item.sequence_index)
                        start = offsets.get(index, 0)
                        offsets[index] = start + len(item.text)
                        so_far += 1
                        if body.logprobs is None and not continuous:
                            chunk.append(call.text_event(index, item))
                            continue
                        logprobs = None if body.logprobs is None else completion_logprobs(
                            [item.token_id], [item.logprob], [item.top_logprobs], body.logprobs, start, tokenizer
                        )
                        chunk.append(sse(call.chunk([{"index": index, "text": item.text, "logprobs": logprobs,
                                                      "finish_reason": None}], call.usage(so_far) if continuous else None)))
                    elif isinstance(item, FinishedRequest):
                        generated += item.generated_tokens
                        finals = [
                            {"index": call.choice_index(request_index, j), "text": "", "logprobs": None,
                             "finish_reason": openai_finish_reason(seq.finish_reason)}
                            for j, seq in enumerate(item.sequences)
                        ]
                        chunk.append(sse(call.chunk(finals, call.usage(so_far) if continuous else None)))
            yield b"".join(chunk)
        if options is not None and options.include_usage:
            yield sse(call.chunk([], call.usage(generated)))
        yield DONE
    except ApiError as exc:
        set_outcome(request, "error")
        yield sse(error_body(exc.error_type, exc.message, "/v1/completions", exc.status))
