"""Log-probabilities and alternatives as each API shows them.

The engine reports, per token, its log-probability and (when asked) its most likely
alternatives as token ids (service/engine/types.py TopLogprobs, PromptScores); this module turns
them into OpenAI's `logprobs` object, vLLM's `prompt_logprobs` and TGI's `top_tokens`.
"""

from __future__ import annotations

from service.engine.types import PromptScores, TopLogprobs
from weights.tokenizer import GPT2Tokenizer


def completion_logprobs(
    ids: list[int],
    logprobs: list[float | None],
    tops: list[TopLogprobs | None] | None,
    n: int,
    offset: int,
    tokenizer: GPT2Tokenizer,
) -> dict:
    """OpenAI's legacy `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset.

    top_logprobs (n > 0): per token, its n most likely alternatives by text, plus the token
    itself when it is not among them (as vLLM answers; lm-evaluation-harness checks greediness
    by comparing the token's log-probability with the largest of these). None where no
    alternatives exist (the first prompt token, which nothing precedes).
    """
    tokens = [tokenizer.decode([t]) for t in ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top_logprobs = None
    if n and tops is not None:
        top_logprobs = [
            None if top is None else by_text(top[:n], token, logprob, tokenizer)
            for top, token, logprob in zip(tops, ids, logprobs)
        ]
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def by_text(top: TopLogprobs, token: int, logprob: float | None, tokenizer: GPT2Tokenizer) -> dict[str, float]:
    out: dict[str, float] = {}
    for alternative, alternative_logprob in top:
        out.setdefault(tokenizer.decode([alternative]), alternative_logprob)
    if logprob is not None and all(t != token for t, _ in top):
        out.setdefault(tokenizer.decode([token]), logprob)
    return out


def vllm_prompt_logprobs(ids: list[int], scores: PromptScores, n: int, tokenizer: GPT2Tokenizer) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), {token id: {logprob,
    rank, decoded_token}} for the token itself and its n most likely alternatives."""
    out: list[dict | None] = []
    for token, logprob, rank, top in zip(ids, scores.logprobs, scores.ranks, scores.top):
        if logprob is None:
            out.append(None)
            continue
        entry = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.decode([token])}}
        for position, (alternative, alternative_logprob) in enumerate((top or [])[:n]):
            entry.setdefault(
                str(alternative),
                {"logprob": alternative_logprob, "rank": position + 1, "decoded_token": tokenizer.decode([alternative])},
            )
        out.append(entry)
    return out


def tgi_top_tokens(top: TopLogprobs, tokenizer: GPT2Tokenizer) -> list[dict]:
    """TGI's top_tokens entry for one generated token: Token objects, most likely first."""
    return [
        {"id": t, "text": tokenizer.decode([t]), "logprob": lp, "special": tokenizer.is_special(t)} for t, lp in top
    ]
