"""From a validated body to engine work: the checks that need the settings or the token counts.

Everything here raises `ApiError` (422 validation) with a message naming the field and the limit,
before anything reaches the engine, so an invalid request never holds a KV-cache slot.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from service.common.errors import validation_error
from service.engine.types import MAX_BAD_WORD_TOKENS, GenerationRequest, SamplingParams
from service.http.grammar import GrammarRequest
from service.http.schemas_openai import CompletionRequest
from service.http.schemas_tgi import TGIParameters
from service.settings import Settings
from weights.tokenizer import GPT2Tokenizer


@dataclass(frozen=True)
class Limits:
    context_length: int  # prompt + generated tokens per sequence
    vocab_size: int
    max_new_tokens: int
    default_max_new_tokens: int
    max_prompts: int
    max_sequences: int  # num_beams, num_return_sequences, best_of, n
    max_stop_sequences: int
    max_stop_chars: int

    @classmethod
    def from_settings(cls, settings: Settings, n_positions: int, vocab_size: int) -> "Limits":
        return cls(
            context_length=settings.context_length(n_positions),
            vocab_size=vocab_size,
            max_new_tokens=settings.max_new_tokens,
            default_max_new_tokens=settings.default_max_new_tokens,
            max_prompts=settings.max_prompts_per_request,
            # A request holds one KV-cache slot per beam or returned sequence.
            max_sequences=min(settings.max_beams, settings.max_batch_size),
            max_stop_sequences=settings.max_stop_sequences,
            max_stop_chars=settings.max_stop_chars,
        )


@dataclass
class Prompt:
    """One prompt as the engine sees it, and as the response must show it."""

    text: str
    ids: list[int]


def check_count(name: str, value: int, limit: int) -> None:
    if value > limit:
        raise validation_error(f"{name} is {value}; this server allows at most {limit}")


def check_stops(stops: list[str], limits: Limits) -> tuple[str, ...]:
    if len(stops) > limits.max_stop_sequences:
        raise validation_error(
            f"stop has {len(stops)} strings; this server allows at most {limits.max_stop_sequences}"
        )
    for stop in stops:
        if len(stop) > limits.max_stop_chars:
            raise validation_error(
                f"stop string {stop[:20]!r}... has {len(stop)} characters; at most {limits.max_stop_chars}"
            )
    return tuple(stops)


# Tokenizing a long prompt takes milliseconds: off the event loop, in a worker thread. Prompts up
# to this many characters in all take less to tokenize (~0.2 ms for 512) than the hand-off to the
# thread and back costs the event loop's process (~0.2 ms of CPU, measured on 2 cores).
INLINE_TOKENIZE_CHARS = 512


async def tokenize_off_loop(tokenizer: GPT2Tokenizer, texts: list[str], truncate: int | None = None) -> list[Prompt]:
    """tokenize_texts, in a worker thread unless the texts are short."""
    if sum(len(text) for text in texts) <= INLINE_TOKENIZE_CHARS:
        return tokenize_texts(tokenizer, texts, truncate)
    return await run_in_threadpool(tokenize_texts, tokenizer, texts, truncate)


def tokenize_texts(tokenizer: GPT2Tokenizer, texts: list[str], truncate: int | None = None) -> list[Prompt]:
    """Encode prompts; `truncate` keeps the last N tokens (TGI's left truncation)."""
    prompts = []
    for text, ids in zip(texts, tokenizer.encode_batch(texts)):
        if truncate is not None and len(ids) > truncate:
            ids = ids[-truncate:]
            text = tokenizer.decode(ids)
        prompts.append(Prompt(text=text, ids=ids))
    return prompts


def prompts_from_ids(tokenizer: GPT2Tokenizer, id_lists: list[list[int]], limits: Limits) -> list[Prompt]:
    for ids in id_lists:
        bad = [t for t in ids if t >= limits.vocab_size]
        if bad:
            raise validation_error(f"token id {bad[0]} is outside the vocabulary (size {limits.vocab_size})")
    return [Prompt(text=tokenizer.decode(ids), ids=ids) for ids in id_lists]


def check_lengths(prompts: list[Prompt], max_new_tokens: int, limits: Limits) -> None:
    check_count("max_new_tokens", max_new_tokens, limits.max_new_tokens)
    for index, prompt in enumerate(prompts):
        if not prompt.ids:
            raise validation_error(f"prompt {index} encodes to no tokens")
        total = len(prompt.ids) + max_new_tokens
        if total > limits.context_length:
            which = f"prompt {index}" if len(prompts) > 1 else "the prompt"
            raise validation_error(
                f"{which} has {len(prompt.ids)} tokens and max_new_tokens is {max_new_tokens}: together "
                f"{total}, more than the {limits.context_length}-token context; shorten the prompt, lower "
                "max_new_tokens, or use `truncate`"
            )


def tgi_sampling(p: TGIParameters, limits: Limits, grammar: GrammarRequest | None) -> SamplingParams:
    """`grammar`: the request's, built (service/http/grammar.py); the route checks it compiles."""
    check_count("num_beams", p.num_beams, limits.max_sequences)
    check_count("num_return_sequences", p.num_return_sequences, limits.max_sequences)
    check_count("best_of", p.best_of or 1, limits.max_sequences)
    if p.top_k is not None:
        check_count("top_k", p.top_k, limits.vocab_size)
    sampling = p.samples
    return SamplingParams(
        max_new_tokens=p.max_new_tokens or limits.default_max_new_tokens,
        do_sample=sampling,
        temperature=p.temperature if p.temperature is not None else 1.0,
        top_k=p.top_k or 0,
        top_p=p.top_p if p.top_p is not None else 1.0,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
        seed=p.seed,
        stop=check_stops(p.stop, limits),
        ignore_eos=p.ignore_eos,
        num_beams=p.num_beams,
        length_penalty=p.length_penalty,
        early_stopping=p.early_stopping,
        # best_of runs as n sampled sequences of one request; the route keeps the best.
        num_return_sequences=max(p.num_return_sequences, p.best_of or 1),
        prompt_logprobs=p.decoder_input_details,
        top_logprobs=alternatives(p.top_n_tokens or 0, p.num_beams),
        speculate=p.speculate,
        grammar=grammar.text if grammar is not None else None,
        **decoding_controls(
            limits, p.num_beams, min_p=p.min_p or 0.0, typical_p=p.typical_p or 1.0,
            min_new_tokens=p.min_new_tokens or 0, stop_token_ids=p.stop_token_ids,
            no_repeat_ngram_size=p.no_repeat_ngram_size or 0, bad_words_ids=p.bad_words_ids,
        ),
    )


def openai_sampling(req: CompletionRequest, limits: Limits, grammar: GrammarRequest | None) -> SamplingParams:
    """One request per prompt; `n`/`best_of` become num_return_sequences when sampling."""
    candidates = req.best_of or req.n
    check_count("n", req.n, limits.max_sequences)
    check_count("best_of", candidates, limits.max_sequences)
    check_count("top_k", req.top_k, limits.vocab_size)
    greedy = req.temperature == 0.0
    return SamplingParams(
        max_new_tokens=openai_max_new_tokens(req, limits),
        do_sample=not greedy,
        temperature=1.0 if greedy else req.temperature,
        top_k=req.top_k,
        top_p=req.top_p,
        repetition_penalty=req.repetition_penalty,
        seed=req.seed,
        stop=check_stops(req.stop_list, limits),
        ignore_eos=req.ignore_eos,
        # Greedy has one answer per prompt: the route submits the prompt n times (rare; keeps
        # the usage it reports equal to the tokens computed).
        num_return_sequences=1 if greedy else candidates,
        prompt_logprobs=(req.echo and req.logprobs is not None) or req.prompt_logprobs is not None,
        # One count serves generated and prompt tokens; the route keeps what each asked for.
        top_logprobs=alternatives(max(req.logprobs or 0, req.prompt_logprobs or 0), 1),
        speculate=req.speculate,
        grammar=grammar.text if grammar is not None else None,
        **decoding_controls(
            limits, 1, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            logit_bias=req.logit_bias, min_p=req.min_p, typical_p=req.typical_p, min_new_tokens=req.min_tokens,
            stop_token_ids=req.stop_token_ids, no_repeat_ngram_size=req.no_repeat_ngram_size,
            bad_words_ids=req.bad_words_ids,
        ),
    )


def openai_max_new_tokens(req: CompletionRequest, limits: Limits) -> int:
    """max_tokens=0 (scoring only) runs as one token the response leaves out, as vLLM does: the
    prompt's scores come from the prefill, which always picks a next token."""
    if req.max_tokens is None:
        return limits.default_max_new_tokens
    return max(req.max_tokens, 1)


def decoding_controls(
    limits: Limits,
    num_beams: int,
    *,
    logit_bias: dict[str, float] | None = None,
    stop_token_ids: list[int] | None = None,
    bad_words_ids: list[list[int]] | None = None,
    **values: float,
) -> dict:
    """SamplingParams' decoding-control fields, token ids checked against the vocabulary."""
    bias = []
    for key, value in (logit_bias or {}).items():
        if not key.isdigit():
            raise validation_error(f"logit_bias keys are token ids; got {key!r}")
        bias.append((check_token("logit_bias", int(key), limits), value))
    stops = tuple(check_token("stop_token_ids", t, limits) for t in stop_token_ids or [])
    bad = []
    for word in bad_words_ids or []:
        if not 1 <= len(word) <= MAX_BAD_WORD_TOKENS:
            raise validation_error(f"bad_words_ids: each sequence has 1 to {MAX_BAD_WORD_TOKENS} token ids")
        bad.append(tuple(check_token("bad_words_ids", t, limits) for t in word))
    fields = {"logit_bias": tuple(bias), "stop_token_ids": stops, "bad_words_ids": tuple(bad), **values}
    neutral = SamplingParams()
    used = sorted(name for name, value in fields.items() if value != getattr(neutral, name))
    if used and num_beams > 1:
        raise validation_error(f"{', '.join(used)}: not applied in beam search here; use sampling or greedy")
    return fields


def check_token(field: str, token: int, limits: Limits) -> int:
    if not 0 <= token < limits.vocab_size:
        raise validation_error(f"{field}: token id {token} is outside the vocabulary (0 to {limits.vocab_size - 1})")
    return token


def alternatives(count: int, num_beams: int) -> int:
    if count and num_beams > 1:
        raise validation_error("top alternatives (top_n_tokens, logprobs) are not computed for beam search")
    return count


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def generation_requests(
    prompts: list[Prompt], params: SamplingParams, prefix: str, adapter: str | None = None
) -> list[GenerationRequest]:
    """One engine request per prompt, all stamped with the same arrival time; `adapter`: the
    LoRA adapter they run with (None: the base model)."""
    now = time.monotonic()
    return [GenerationRequest(new_request_id(prefix), p.ids, params, now, adapter) for p in prompts]
