"""Hugging Face TGI's routes: POST /generate, /generate_stream and / (either, by "stream").

Its clients (huggingface_hub.InferenceClient.text_generation, text-generation) work unchanged.
Differences from TGI: generated_text never contains the stop string (as OpenAI's API), and
`inputs` may also be a list of prompts, generated together and answered as a list.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from service.http.admission import Prompt, check_count, check_lengths, generation_requests, tgi_sampling, tokenize_off_loop
from service.common.errors import ApiError, error_body, validation_error
from service.http.generation import CallStreams
from service.http.grammar import tgi_grammar
from service.common.metrics import set_outcome
from service.engine.types import FinishedRequest, FinishedSequence, GenerationRequest, TokenEvent
from service.http.scoring import tgi_top_tokens
from service.http.schemas_tgi import GenerateResponse, TGIParameters, TGIRequest
from service.http.body_writer import BodyWriter, body_writer
from service.http.sse import SERVER_SEND, EventStream, json_string, sse
from service.http.state import ServiceState, service_state
from weights.tokenizer import GPT2Tokenizer

router = APIRouter(tags=["TGI"])

ERRORS = {
    422: {"description": "invalid input: {error, error_type: validation}"},
    429: {"description": "queue full: {error, error_type: overloaded}, Retry-After"},
}
CLIENT_GONE = 499  # nginx's code for "client closed the request": never seen by the client


@router.post(
    "/generate",
    response_model=GenerateResponse | list[GenerateResponse | list[GenerateResponse]],
    responses=ERRORS,
    summary="Generate text (TGI schema); a list of inputs is answered as a list",
)
async def generate(body: TGIRequest, request: Request) -> Response:
    state = service_state(request)
    prompts, requests = await admit(state, body)
    results = await state.generations.complete(requests, request)
    if results is None:
        return Response(status_code=CLIENT_GONE)
    outputs = [tgi_output(p, r, body.parameters, state.tokenizer) for p, r in zip(prompts, results)]
    return JSONResponse(outputs[0] if isinstance(body.inputs, str) else outputs)


@router.post(
    "/generate_stream",
    response_class=EventStream,
    status_code=200,
    responses={200: {"content": {"text/event-stream": {}}, "description": "one event per token"}, **ERRORS},
    summary="Generate text as server-sent events, one per token (TGI schema)",
)
async def generate_stream(body: TGIRequest, request: Request) -> Response:
    state = service_state(request)
    check_streamable(body)
    prompts, requests = await admit(state, body)
    batch = state.generations.submit(requests)
    numbering = TokenNumbering(state.tokenizer, body_writer(request.scope.get(SERVER_SEND)))
    return EventStream(
        tgi_events(state, batch, prompts[0], body.parameters, request, numbering),
        on_close=lambda: state.generations.end(batch, request),
    )


@router.post(
    "/",
    # With stream=true the answer is /generate_stream's event stream: documented, as clients see it.
    responses={200: {"content": {"text/event-stream": {}}}, **ERRORS},
    summary="TGI's compatibility route: /generate or, with stream=true, /generate_stream",
)
async def compat_generate(body: TGIRequest, request: Request) -> Response:
    if body.stream:
        return await generate_stream(body, request)
    return await generate(body, request)


async def admit(state: ServiceState, body: TGIRequest) -> tuple[list[Prompt], list[GenerationRequest]]:
    limits = state.limits
    grammar = tgi_grammar(body.parameters)
    params = tgi_sampling(body.parameters, limits, grammar)
    await state.grammars.check(grammar)  # compiled with its first masks, off the event loop
    check_count("the number of prompts in inputs", len(body.prompts), limits.max_prompts)
    prompts = await tokenize_off_loop(state.tokenizer, body.prompts, body.parameters.truncate)
    check_lengths(prompts, params.max_new_tokens, limits)
    adapter = state.served_adapter(body.parameters.adapter_id, "validation")
    return prompts, generation_requests(prompts, params, "tgi", adapter)


def check_streamable(body: TGIRequest) -> None:
    p = body.parameters
    if not isinstance(body.inputs, str):
        raise validation_error("streaming takes one prompt: `inputs` must be a string")
    if (p.best_of or 1) > 1:
        raise validation_error("best_of > 1 is not supported when streaming tokens")
    if p.decoder_input_details:
        raise validation_error("decoder_input_details is not supported when streaming tokens")
    if p.num_beams > 1:
        raise validation_error("beam search cannot be streamed: the best beam is known only at the end")
    if p.num_return_sequences > 1:
        raise validation_error("num_return_sequences > 1 cannot be streamed here; use /v1/completions with n")


# --- response bodies ---------------------------------------------------------------------------


def tgi_output(prompt: Prompt, result: FinishedRequest, p: TGIParameters, tokenizer: GPT2Tokenizer) -> dict | list:
    prefill = prefill_tokens(prompt.ids, result.prompt_logprobs, tokenizer) if p.decoder_input_details else []

    def one(seq: FinishedSequence) -> dict:
        out = {"generated_text": generated_text(prompt, seq, p)}
        if p.details:
            out["details"] = {
                "finish_reason": tgi_finish_reason(seq.finish_reason),
                "generated_tokens": len(seq.token_ids),
                "seed": result.seed,
                "prefill": prefill,
                "tokens": token_details(seq, tokenizer),
            }
            if p.top_n_tokens:
                out["details"]["top_tokens"] = [tgi_top_tokens(top, tokenizer) for top in seq.top_logprobs or []]
        return out

    sequences = result.sequences
    if (p.best_of or 1) > 1:
        # TGI's best_of: the candidate with the highest total log-probability; the others
        # go in details.best_of_sequences.
        ranked = sorted(sequences, key=lambda s: sum(s.logprobs), reverse=True)
        best = one(ranked[0])
        if p.details:
            others = [one(s) for s in ranked[1:]]
            best["details"]["best_of_sequences"] = [{"generated_text": o["generated_text"], **o["details"]} for o in others]
        return best
    if len(sequences) == 1:
        return one(sequences[0])
    return [one(s) for s in sequences]


def generated_text(prompt: Prompt, seq: FinishedSequence, p: TGIParameters) -> str:
    return (prompt.text if p.return_full_text else "") + seq.text


def prefill_tokens(ids: list[int], logprobs: list[float | None] | None, tokenizer: GPT2Tokenizer) -> list[dict]:
    logprobs = logprobs or [None] * len(ids)
    return [{"id": t, "text": tokenizer.decode([t]), "logprob": lp} for t, lp in zip(ids, logprobs)]


def token_details(seq: FinishedSequence, tokenizer: GPT2Tokenizer) -> list[dict]:
    return [
        {"id": t, "text": tokenizer.decode([t]), "logprob": lp, "special": tokenizer.is_special(t)}
        for t, lp in zip(seq.token_ids, seq.logprobs)
    ]


# --- streaming -----------------------------------------------------------------------------------


class TokenNumbering:
    """A TGI stream's token count (`index`, from 1); `writer`: the connection's, for the core
    reader to write the per-token events itself (service/http/body_writer.py), if the server allows."""

    def __init__(self, tokenizer: GPT2Tokenizer, writer: BodyWriter | None) -> None:
        self.special_ids = tokenizer.special_ids
        self.writer = writer
        self.index = 0

    def plain_event(self, event: TokenEvent) -> bytes:
        """The next token's event, sse(stream_token(...)) written directly: every event of a TGI
        stream but the last and those with top tokens, so one per token. Written from a template
        with json_string and the logprob's repr (json.dumps writes a finite float so; NaN and the
        infinities by name): json.dumps's bytes (tests/service/test_sse.py) at a fraction of its
        cost. orjson and msgspec are faster still but write other bytes (no space after `:` and
        `,`; 1e-05 as 1e-5)."""
        self.index += 1
        logprob = event.logprob
        number = float.__repr__(logprob) if math.isfinite(logprob) else json.dumps(logprob)
        special = "true" if event.token_id in self.special_ids else "false"
        return (f'data: {{"index": {self.index}, "token": {{"id": {event.token_id}, "text": {json_string(event.text)}, '
                f'"logprob": {number}, "special": {special}}}, "generated_text": null, "details": null}}\n\n').encode()


async def tgi_events(
    state: ServiceState, batch: CallStreams, prompt: Prompt, p: TGIParameters, request: Request,
    numbering: TokenNumbering,
) -> AsyncIterator[bytes]:
    """TGI's stream: one event per token; the last also carries generated_text (and details)."""
    tokenizer = state.tokenizer
    # Events with top tokens are not plain ones: such a stream sends every event itself.
    writer = numbering.writer if not p.top_n_tokens else None
    direct = writer.token_sink(numbering.plain_event) if writer is not None else None
    try:
        async for arrived in state.generations.events(batch, request, direct):
            chunk = []
            for _, items in arrived:
                tokens, finished = [], None
                for item in items:
                    if isinstance(item, TokenEvent):
                        tokens.append(item)
                    elif isinstance(item, FinishedRequest):
                        finished = item
                for position, event in enumerate(tokens):
                    last = finished is not None and position == len(tokens) - 1
                    if event.top_logprobs is None and not last:
                        chunk.append(numbering.plain_event(event))
                        continue
                    numbering.index += 1
                    index = numbering.index
                    payload = stream_token(event.token_id, event.text, event.logprob, index, tokenizer)
                    if event.top_logprobs is not None:
                        payload["top_tokens"] = tgi_top_tokens(event.top_logprobs, tokenizer)
                    if last:
                        payload.update(stream_end(finished, prompt, p))
                    chunk.append(sse(payload))
                if finished is not None and not tokens:
                    # Finished without a token in this delivery (it was the engine's choice to end):
                    # TGI's last event still needs a token to hang the details on.
                    seq = finished.sequences[0]
                    token_id = seq.token_ids[-1] if seq.token_ids else tokenizer.eos_token_id
                    payload = stream_token(token_id, "", seq.logprobs[-1] if seq.logprobs else 0.0, numbering.index,
                                           tokenizer)
                    payload.update(stream_end(finished, prompt, p))
                    chunk.append(sse(payload))
            yield b"".join(chunk)
    except ApiError as exc:
        # The 200 and earlier tokens are already sent: the error travels as TGI sends it, as an event.
        set_outcome(request, "error")
        yield sse(error_body(exc.error_type, exc.message))


def stream_token(token_id: int, text: str, logprob: float, index: int, tokenizer: GPT2Tokenizer) -> dict:
    token = {"id": token_id, "text": text, "logprob": logprob, "special": tokenizer.is_special(token_id)}
    return {"index": index, "token": token, "generated_text": None, "details": None}


def tgi_finish_reason(reason: str) -> str:
    # TGI has no reason for an answer the server cut short (a drain's deadline): like OpenAI's
    # "length", it says the text stopped before the model chose to.
    return "length" if reason == "cancelled" else reason


def stream_end(result: FinishedRequest, prompt: Prompt, p: TGIParameters) -> dict:
    seq = result.sequences[0]
    end = {"generated_text": generated_text(prompt, seq, p), "details": None}
    if p.details:
        end["details"] = {
            "finish_reason": tgi_finish_reason(seq.finish_reason),
            "generated_tokens": len(seq.token_ids),
            "input_length": result.prompt_tokens,
            "seed": result.seed,
        }
    return end
