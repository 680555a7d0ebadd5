"""Prompt scores (echo, prompt_logprobs, decoder_input_details) from a prefill chunk's hidden
states: each prompt token's log-probability, rank and top alternatives, chunk by chunk."""

from __future__ import annotations

import torch

from model.gpt2 import GPT2
from model.scoring import score_tokens
from service.engine.requests import PrefillChunk, RequestState
from service.engine.types import PromptScores

# Prompt log-probabilities go through the LM head this many positions at a time, so a long
# prompt never materialises [prompt, vocab] logits at once.
PROMPT_LOGPROB_CHUNK = 256


def add_prompt_scores(model: GPT2, state: RequestState, chunk: PrefillChunk, hidden: torch.Tensor) -> None:
    """Score the prompt tokens this chunk's hidden states [T, C] predict: start+1 .. end (the
    token after the chunk is the next chunk's first, or, after the last one, generated)."""
    prompt = state.request.prompt_ids
    end = min(chunk.end + 1, len(prompt))
    scores = prompt_scores(model, hidden[: end - chunk.start - 1], prompt[chunk.start + 1 : end], state.params.top_logprobs)
    if state.prompt_scores is None:
        state.prompt_scores = PromptScores([None], [None], [None])
    state.prompt_scores.logprobs += scores.logprobs
    state.prompt_scores.ranks += scores.ranks
    state.prompt_scores.top += scores.top


def prompt_scores(model: GPT2, hidden: torch.Tensor, targets: list[int], n: int) -> PromptScores:
    """How the model scores targets[i] from hidden states [m, C] (row i precedes it):
    log-probability, rank and n alternatives, copied to the host at once."""
    target_ids = torch.tensor(targets, device=hidden.device)  # [m]
    chunks = []
    for start in range(0, len(targets), PROMPT_LOGPROB_CHUNK):
        end = min(start + PROMPT_LOGPROB_CHUNK, len(targets))
        logits = model.lm_head(model.ln_f(hidden[start:end])).float()  # [m', V]
        s = score_tokens(logits, target_ids[start:end], n)
        # [m', 2 + 2n]: logprob, rank, alternatives' ids, their logprobs (float64 holds ids exactly)
        chunks.append(torch.cat([s.logprobs[:, None].double(), s.ranks[:, None].double(),
                                 s.top_ids.double(), s.top_logprobs.double()], dim=1))
    rows = torch.cat(chunks).tolist() if chunks else []
    top = [list(zip(map(int, r[2 : 2 + n]), r[2 + n :])) for r in rows]
    return PromptScores([r[0] for r in rows], [int(r[1]) for r in rows], top)
