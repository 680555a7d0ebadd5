"""Beam-search requests inside the engine: a request owns num_beams slots, one per beam, and its
beams are rows of the batched step like any other (drawn by the sampler, their draws unused).

A step's beams go three ways, as transformers' batched beam search does, split at the step's one
device→host copy:
- at launch (`launch_candidates`): every beam request's candidates in one batched operation on
  the device (model/beam.py's `candidate_parts`: log_softmax, repetition_penalty, + running
  scores, top 2 * num_beams over [num_beams x V]); a few numbers per request ride the sampler's
  copy;
- when the step is read (`advance_beam_requests`): each search's bookkeeping on the host from
  those numbers (model/beam.py's `BeamSearch.advance`), which says which beam continues which
  and with what token;
- when it is read, too: a beam continuing another beam on a row of its own shares that beam's
  KV blocks (copy on write for the last, partial one: model/kv_cache.py);
- in the next plan (`apply_beam_moves`): who holds each slot and the beams' next tokens, before
  any forward reads them.

A beam request needs its search's answer before its next step: it is host-paced (it sits out the
steps launched before its step is read; overlap stays on for the others). The beams' sequences stay
in beam order: sequence i is beam i, whatever slot it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from model.beam import BeamParams, BeamSearch, candidate_parts, split_candidates
from model.transfer import to_device
from service.engine.faults import RowFault, RowFaultError, beam_failed, nonfinite
from service.engine.input_batch import InputBatch
from service.engine.requests import RequestState, Sequence
from service.engine.step_data import BeamRows, LaunchedBeams
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


@dataclass
class BeamMove:
    """What a search's step asks of the next plan: beam i now holds slots[i] (each beam continues
    its source beam on that beam's own slot where it is the first to continue it, so most steps
    copy nothing), `copies` (source slot, slot) give the others their source's first `length`
    cached positions (shared blocks), and each feeds tokens[i] next."""

    sequences: list[Sequence]
    slots: list[int]
    copies: list[tuple[int, int]]
    length: int
    tokens: list[int]


def continue_beams(slots: list[int], sources: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Beam i continues beam sources[i] (slots: each beam's slot now): the slot each beam holds
    next and the copies that fill those that are not their source's own. A source continued by
    several beams keeps its slot for the first; the others take the slots of beams nobody
    continues (never a copy's source, so the copies' order is free)."""
    claimed, continued = [False] * len(slots), set(sources)
    free = [slot for beam, slot in enumerate(slots) if beam not in continued]
    held, copies = [], []
    for source in sources:
        if not claimed[source]:
            claimed[source] = True
            held.append(slots[source])
        else:
            slot = free.pop()
            held.append(slot)
            copies.append((slots[source], slot))
    return held, copies


def beam_groups(sampled: list[tuple[RequestState, Sequence]], among: list[int] | None = None) -> list[BeamRows]:
    """The beam requests of a step's sampled rows (`among`: the only rows that may be beams,
    when known), each with its rows in beam order."""
    groups: dict[int, list[tuple[int, int]]] = {}
    states: dict[int, RequestState] = {}
    for row in range(len(sampled)) if among is None else among:
        state, seq = sampled[row]
        if state.beam is not None:
            groups.setdefault(id(state), []).append((seq.index, row))
            states[id(state)] = state
    return [BeamRows(states[key], [row for _, row in sorted(rows)]) for key, rows in groups.items()]


def candidates_width(groups: list[BeamRows]) -> int:
    """1 + 3k: the width of `launch_candidates`' rows (k: the most candidates a search keeps)."""
    return 1 + 3 * max(group.state.beam.candidates for group in groups)


def launch_candidates(step_logits: torch.Tensor, groups: list[BeamRows], out: torch.Tensor) -> torch.Tensor:
    """`out`: [R, 1 + 3k] float64 on the device (`candidates_width`), one row per group: the sum of
    its logits (finite exactly when every one of them is), then its candidates
    (`beam_candidates`). `step_logits`: [B, V], one row per sampled row. Every operation here
    runs each step a beam search does, so they are few: on a GPU each is a kernel launch, on a
    CPU each costs the host."""
    searches = [group.state.beam for group in groups]
    width = max(search.params.num_beams for search in searches)
    rows = np.empty((len(groups), width), dtype=np.int64)
    running = np.full((len(groups), width), -np.inf, dtype=np.float32)  # padding: never a candidate
    for i, (group, search) in enumerate(zip(groups, searches)):
        beams = search.params.num_beams
        # The first step expands the prompt's row (beam 0's) over every beam, as transformers does.
        rows[i] = group.rows[0] if search.first_step else group.rows + group.rows[:1] * (width - beams)
        running[i, :beams] = search.running_scores
    device = step_logits.device
    logits = step_logits[to_device(rows, device)]  # [R, N, V]
    # In float64, which no sum of float32 (or half) values overflows: an fp16 model's logits
    # summed in their own type would overflow (GPT-2's are near -100 over 50,257 tokens) and
    # fail a sound search.
    sums = logits.view(len(groups), -1).sum(dim=1, keepdim=True, dtype=torch.float64)  # [R, 1]
    parts = candidate_parts(logits, to_device(running, device, torch.float32), searches)
    return torch.cat([sums, *parts], dim=1, out=out)  # each cast as it is copied


@dataclass
class BeamOutcome:
    """What the searches' steps said: the next plan's moves, the searches done, those failed."""

    moves: list[BeamMove]
    done: list[RequestState]
    failed: list[tuple[RequestState, RowFault]]


def advance_beam_requests(beams: LaunchedBeams) -> BeamOutcome:
    """Each search's step from its candidates, read with the step. A search that fails (its
    logits not finite, or raising) is reported alone; its beams are left as they were."""
    outcome = BeamOutcome([], [], [])
    for group, row in zip(beams.groups, beams.candidates.tolist()):
        state = group.state
        sequences = state.sequences
        if sequences[0].finish_reason is not None:  # ended (failed, cancelled) since its step was launched
            continue
        search = state.beam
        try:
            if not math.isfinite(row[0]):  # the sum of its logits
                raise RowFaultError(nonfinite(len(sequences[0].token_ids) - sequences[0].prompt_length + 1))
            step = search.advance(*split_candidates(row[1:], search.candidates), beams.vocab)
        except Exception as exc:
            outcome.failed.append((state, exc.fault if isinstance(exc, RowFaultError) else beam_failed(exc)))
            continue
        if step.done:  # finish() gives each hypothesis its reason
            outcome.done.append(state)
            continue
        # Every beam has cached all of its tokens (the prompt, then each one fed since); the
        # first step copies the prompt from beam 0 to every other beam continuing it.
        slots, copies = continue_beams([seq.slot for seq in sequences], step.source_beams)
        outcome.moves.append(BeamMove(sequences, slots, copies, len(sequences[0].token_ids), step.next_tokens))
        # Each beam's tokens are its source's: the beam keeping its source's slot keeps its list,
        # the others copy it (all copies made before any list grows).
        copied = {slot for _, slot in copies}
        token_ids = [sequences[source].token_ids[:] if slot in copied else sequences[source].token_ids
                     for source, slot in zip(step.source_beams, slots)]
        for seq, ids, slot, token in zip(sequences, token_ids, slots, step.next_tokens):
            ids.append(token)
            seq.token_ids, seq.slot = ids, slot
            seq.cached = len(ids) - 1
    return outcome


def apply_beam_moves(batch: InputBatch, moves: list[BeamMove]) -> None:
    """The searches' moves, before anything else of the plan (packing moves read the slots as the
    searches left them): who holds each slot, and the token each beam's next decode feeds (from
    `last_tokens`). Their cache was reordered when the step was read: a beam continuing another on
    a row of its own took that beam's blocks (the scheduler's `_advance_beams`)."""
    for move in moves:
        for seq, slot in zip(move.sequences, move.slots):
            batch.hold(slot, seq)
    slots = [slot for move in moves for slot in move.slots]
    tokens = [token for move in moves for token in move.tokens]
    # unbind, not unpacking (Tensor.__iter__'s Python); index_copy_: the slots are distinct.
    index, values = to_device([slots, tokens], batch.last_tokens.device).unbind()
    batch.last_tokens.index_copy_(0, index, values)


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
