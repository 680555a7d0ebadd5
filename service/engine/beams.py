"""Beam-search requests inside the engine: a request owns num_beams slots, one per beam.

model/beam.py does the bookkeeping (transformers' semantics); this module connects it to the
engine's sequences and KV-cache slots, so beam requests share batches with all others.
"""

from __future__ import annotations

import torch

from model.beam import BeamParams, BeamSearch, reorder_beam_slots
from model.kv_cache import KVCache
from service.engine.faults import RowFaultError, nonfinite
from service.engine.requests import RequestState
from service.engine.types import FinishedSequence, SamplingParams


def start_beam_search(params: SamplingParams, prompt: list[int], eos_token_id: int) -> BeamSearch:
    beam_params = BeamParams(
        num_beams=params.num_beams,
        length_penalty=params.length_penalty,
        early_stopping=params.early_stopping,
        num_return_sequences=params.num_return_sequences,
        eos_token_id=None if params.ignore_eos else eos_token_id,
        max_new_tokens=params.max_new_tokens,
        repetition_penalty=params.repetition_penalty,
    )
    return BeamSearch(beam_params, prompt)


def advance_beams(state: RequestState, logits: torch.Tensor, row_of: dict[int, int], cache: KVCache) -> bool:
    """One beam-search step from this step's logits [rows, V]; True when the search is done.

    The beams' sequences stay in beam order: sequence i is beam i, whatever slot it holds.
    """
    beams = state.sequences
    if len(beams[0].token_ids) == beams[0].prompt_length:
        beam_logits = logits[row_of[beams[0].slot]][None]  # [1, V]: the prompt ran once
    else:
        rows = torch.tensor([row_of[b.slot] for b in beams], device=logits.device)  # [num_beams]
        beam_logits = logits[rows]  # [num_beams, V]
    if not torch.isfinite(beam_logits).all():  # the search reads its scores on the host anyway
        raise RowFaultError(nonfinite(len(beams[0].token_ids) - beams[0].prompt_length + 1))
    step = state.beam.step(beam_logits)
    if step.done:
        return True
    # Every beam has cached all of its tokens (the prompt, then each one fed since), and the
    # first step's reorder copies the prompt from beam 0 to every beam continuing it.
    reorder_beam_slots(cache, [b.slot for b in beams], step.source_beams, len(beams[0].token_ids))
    token_ids = [beams[src].token_ids + [token] for src, token in zip(step.source_beams, step.next_tokens)]
    for beam, ids in zip(beams, token_ids):
        beam.token_ids = ids
        beam.cached = len(ids) - 1
    return False


def beam_results(state: RequestState) -> list[FinishedSequence]:
    """The best num_return_sequences hypotheses, best first (the HTTP side decodes their text)."""
    return [
        FinishedSequence(
            token_ids=hypothesis.token_ids,
            text="",
            logprobs=hypothesis.token_logprobs,
            finish_reason=hypothesis.finish_reason,
            score=hypothesis.score,
        )
        for hypothesis in state.beam.finish()
    ]
