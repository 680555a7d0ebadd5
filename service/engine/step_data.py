"""What crosses between the engine's parts in one step: the runner's layout of the step's rows
(StepRows, with the facts gathered from its input batch, RowFacts) and the step it launched
(LaunchedStep), which the scheduler reads once its tokens reach the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from model.sampling import SamplingTensors
from service.engine.faults import RowFault
from service.engine.requests import RequestState, Sequence
from service.engine.row_features import RowFeatures
from service.engine.types import TopLogprobs


# Columns of the input batch's host table (input_batch.py), which RowFacts.table copies. LAST: the
# counter of its last draw (max_new_tokens reached with it); EOS: the token that ends it (-1 with
# ignore_eos); LENGTH: the counter of its next draw, len(token_ids) + pending (grown at each
# launch, set after a drafted step's read).
LAST, PROMPT_LENGTH, EOS, LENGTH = range(4)


@dataclass
class RowFacts:
    """A step's sampled rows, gathered from the input batch at launch (the slots may be reused or
    moved before the step's tokens are read): what the host reads them with, and what the sampler
    draws them with on the device."""

    features: RowFeatures
    request_ids: list[str]
    indexes: list[int]  # sequence index within the request
    slots: np.ndarray  # [B] the rows' slots
    counters: np.ndarray  # [B] tokens the row's sequence holds when its token is drawn
    table: np.ndarray  # [B, 4] their rows of the batch's host table (a copy): LAST, PROMPT_LENGTH, EOS, LENGTH
    # [B, MAX_STOP_IDS] the rows' stop token ids (-1: none), when a row has some; each row's count
    # of alternatives asked for, when a row asks.
    stop_ids: np.ndarray | None = None
    wanted: list[int] | None = None
    own: list[int] | None = None  # the rows read with Python of their own (a drafter, a beam), when any
    constrained: list[int] | None = None  # the rows a grammar constrains, when any
    # On the device: the rows' sampling parameters and controls, and the tokens they have seen
    # (for a repetition penalty, when a row has one).
    sampling: SamplingTensors | None = None
    seen: torch.Tensor | None = None


@dataclass
class BeamRows:
    """One beam request's rows among a step's sampled rows, in beam order."""

    state: RequestState
    rows: list[int]


@dataclass
class LaunchedBeams:
    """A launched step's beam requests and, once it is read, their candidates on the host
    (service/engine/beams.py)."""

    groups: list[BeamRows]
    candidates: torch.Tensor  # [R, 1 + 3k] float64, a view of the step's host copy
    vocab: int


@dataclass
class StepRows:
    """The layout of one step's logits, known before the forwards run."""

    decoding: list[Sequence]  # the decode batch, in slot order
    row_of: dict[int, int]  # slot → its (first) row in the step's logits
    # What the sampler draws for (beams aside): one row per sequence, 1 + k for one with a
    # draft of k tokens (its rows are consecutive).
    sampled: list[tuple[RequestState, Sequence]]
    sample_rows: torch.Tensor  # [B] logits row of each sampled sequence
    sample_slots: torch.Tensor  # [B] its KV-cache slot (and parameter-table row)
    sample_counters: torch.Tensor  # [B] tokens its sequence holds: which draw of its seed
    # Sampled row b is logits row b and slot b's, for every b (rows after them, prompt chunks
    # that sample nothing, are left alone): the usual step once the running sequences are
    # packed into slots 0..B-1 (a persistent batch). The per-slot tables are then read as views
    # of their first B rows and the logits as a view of theirs, with no gather (on a GPU: no
    # [B, V] copy and no index kernels).
    facts: RowFacts  # the sampled rows' facts from the input batch (service/engine/input_batch.py)
    in_slot_order: bool = False
    # The decoding sequences verifying a draft this step (their lengths and last tokens are set
    # once it is read); empty: none.
    drafted: list[Sequence] = field(default_factory=list)
    # Every decoding row feeds its slot's last sampled token from the device (`last_tokens`) at
    # the position its counter gives (no beams or drafts running).
    from_device: bool = False
    # What selects the sampled rows of a per-slot table: a slice of the first B when in slot order,
    # else sample_slots.
    read: torch.Tensor | slice | None = None
    # Sampled row b is logits row b for every b, whatever their slots (a step's decode rows always
    # are: the logits need no gather).
    logits_in_order: bool = False
    # In a step verifying drafts: the sampled rows of the sequences without one (one row each).
    undrafted: list[int] | np.ndarray = field(default_factory=list)
    # The beam requests among the sampled rows (their draws unused: service/engine/beams.py).
    beams: list[BeamRows] = field(default_factory=list)



@dataclass
class LaunchedStep:
    """A step whose forwards and sampling are queued on the device; its tokens not yet read."""

    rows: StepRows
    active: list[RequestState]  # the requests it ran (prefill completing, then decoding)
    completing: list[RequestState]  # of which those whose prompt it finished
    sampled: torch.Tensor | None  # [B, 2 + 2n] on the host once `ready` has passed
    alternatives: int  # n
    ready: torch.cuda.Event | None  # recorded after the device→host copy (CUDA only)
    # Read after the next step was launched (overlap): its rows count as pending meanwhile (the
    # next step feeds their tokens from the device).
    deferred: bool = False
    # Requests a sequence of which ended in this step (found when it is read): the only ones
    # that can have finished.
    ended: list[RequestState] = field(default_factory=list)
    # The scheduler's count of ended sequences once it was launched: unchanged when its tokens
    # are read, none of its rows can have ended in between.
    releases: int = 0
    # Sampled rows already known to have failed at launch (a grammar's mask), by row: their
    # requests end with these faults when the step is read.
    faults: dict[int, RowFault] = field(default_factory=dict)
    # Requests failed by this step's rows (a grammar's mask, logits not finite, a beam search),
    # once it is read; already ended in the scheduler.
    failed: list[tuple[RequestState, RowFault]] = field(default_factory=list)
    # Logits whose draw waits for the step before to be read (a constrained row's last token is in
    # flight: StepSampler.launch); None once drawn.
    awaiting: torch.Tensor | None = None
    # Chaos tests only: each row's (seed, draw) for the non-finite injection, taken at launch.
    injected: list[tuple[int | None, int]] | None = None
    # Its beam requests' candidates, which ride the sampler's copy (service/engine/beams.py).
    beams: LaunchedBeams | None = None


def alternatives(row: list[float], n: int, wanted: int) -> TopLogprobs | None:
    """A host row [token, logprob, n ids, n logprobs] → the first `wanted` alternatives; none a
    grammar forbids (-inf: a constrained row may allow fewer tokens than were asked for)."""
    if not wanted:
        return None
    pairs = zip(map(int, row[2 : 2 + wanted]), row[2 + n : 2 + n + wanted])
    return [(token, logprob) for token, logprob in pairs if logprob != -math.inf]
