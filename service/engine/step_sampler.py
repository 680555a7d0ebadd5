"""The sampling stage of a step: each KV-cache slot's decoding parameters and controls as device
tensors, the draw over a step's logits, and the one device→host copy of what it drew.

`launch` queues the draw and the copy and returns at once (on CUDA the host goes on while the
device works: the engine core's overlap); `read` waits for the copy and returns the tokens.
The sampler also leaves each slot's token in `last_tokens` on the device, which the next step's
decode feeds when the host has not read it yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from model.sampling import choose_tokens
from model.scoring import top_alternatives
from model.transfer import to_device
from service.engine.faults import NonfiniteInjection, RowFault, grammar_failed
from service.engine.grammar import Grammars
from service.engine.scheduler import RequestState, Sequence
from service.engine.slot_controls import SlotControls
from service.engine.slot_params import SlotParams
from service.engine.slot_rows import RowFacts
from service.engine.types import SamplingParams, TopLogprobs


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
    facts: RowFacts  # the sampled rows' facts from the slot tables (service/engine/slot_rows.py)
    in_slot_order: bool = False
    drafted: bool = False  # a decoding sequence verifies a draft this step
    # Every decoding row feeds its slot's last sampled token from the device (`last_tokens`) at
    # the position its counter gives (no beams or drafts running).
    from_device: bool = False


    @property
    def read(self) -> torch.Tensor | slice:
        """What selects the sampled rows of a per-slot table: a slice when in slot order."""
        return slice(0, len(self.sampled)) if self.in_slot_order else self.sample_slots


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
    # Requests a sequence of which ended in this step (beams at launch, the rest when read):
    # the only ones that can have finished.
    ended: list[RequestState] = field(default_factory=list)
    # The scheduler's count of ended sequences once it was launched: unchanged when its tokens
    # are read, none of its rows can have ended in between.
    releases: int = 0
    # Sampled rows already known to have failed at launch (a grammar's mask), by row: their
    # requests end with these faults when the step is read.
    faults: dict[int, RowFault] = field(default_factory=dict)
    # Requests that failed at launch (a beam search's step), already ended in the scheduler.
    failed: list[tuple[RequestState, RowFault]] = field(default_factory=list)


class StepSampler:
    def __init__(
        self, max_slots: int, vocab_size: int, max_len: int, eos_token_id: int, device: torch.device,
        grammars: Grammars | None, injection: NonfiniteInjection | None = None,
    ) -> None:
        self.slot_params = SlotParams(max_slots, vocab_size, device)
        self.slot_controls = SlotControls(max_slots, vocab_size, max_len, eos_token_id, device)
        self.grammars = grammars
        # Each slot's last sampled token, on the device: what a step launched before the host
        # read the previous one's tokens feeds.
        self.last_tokens = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.injection = injection  # chaos tests only (faults.py)

    def write(self, slot: int, params: SamplingParams, prompt: list[int], seed: int) -> None:
        self.slot_params.write(slot, params, prompt, seed)
        self.slot_controls.write(slot, params, prompt)

    def move(self, src: int, dst: int) -> None:
        self.slot_params.move(src, dst)
        self.slot_controls.move(src, dst)
        self.last_tokens[dst] = self.last_tokens[src]

    def launch(
        self, logits: torch.Tensor, rows: StepRows, active: list[RequestState], completing: list[RequestState],
        deferred: bool = False,
    ) -> LaunchedStep:
        """Queue the sampling of every sampled row and the copy of its results to the host.
        `deferred`: the tokens will be read after the next step is launched (no drafts then)."""
        if not rows.sampled:
            return LaunchedStep(rows, active, completing, None, 0, None, deferred)
        slots, read = rows.sample_slots, rows.read
        features = rows.facts.features
        params = self.slot_params.gather(read, features)
        params.controls = self.slot_controls.gather(read, rows.sample_counters, features)
        seen = self.slot_params.seen(read) if params.any_penalty else None
        step_logits = logits[: len(rows.sampled)] if rows.in_slot_order else logits[rows.sample_rows]  # [B, V]
        if self.injection is not None:
            step_logits = self.injection.apply(
                step_logits, [(state.params.seed, len(seq.token_ids) + seq.pending - seq.prompt_length) for state, seq in rows.sampled])
        faults = {}
        if features.grammar:
            # The grammar's forbidden tokens at -inf before anything reads the logits: the
            # sampler, the log-probabilities and the alternatives see the constrained
            # distribution. Unconstrained rows are untouched (their values, their bits).
            banned, errors = self.grammars.banned([seq.matcher for _, seq in rows.sampled], step_logits.device,
                                                  draft_prefixes(rows))
            step_logits = step_logits.masked_fill(banned, float("-inf"))
            faults = {row: grammar_failed(error) for row, error in errors.items()}
        tokens, logprobs = choose_tokens(step_logits, params, rows.sample_counters, seen)  # [B], [B]
        if params.any_penalty:
            self.slot_params.mark_seen(slots, tokens)
        self.slot_controls.record(params.controls, slots, rows.sample_counters, tokens)
        if not rows.drafted:  # the next step's inputs (a drafted step's are known once it is read)
            self.last_tokens[read] = tokens
        columns = [tokens[:, None].double(), logprobs[:, None].double()]
        # Alternatives: as many as the most demanding row asked for; each row keeps its own count.
        n = features.top_logprobs
        if n:
            top_ids, top_logprobs = top_alternatives(step_logits.float(), n)  # [B, n], [B, n]
            columns += [top_ids.double(), top_logprobs.double()]
        # The sampler's one device→host copy: tokens, their log-probs and alternatives together
        # (float64 holds every token id exactly). [B, 2 + 2n]. Queued, not waited for: on CUDA
        # the host goes on (non_blocking lands in pinned memory) and `read` waits for the event.
        host = torch.cat(columns, dim=1).to("cpu", non_blocking=True)
        ready = None
        if host.device != logits.device and logits.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return LaunchedStep(rows, active, completing, host, n, ready, deferred, faults=faults)

    def set_last_tokens(self, slots: list[int], tokens: list[int]) -> None:
        """The host's last tokens of the sequences on `slots` (distinct), after a drafted step."""
        self.last_tokens[to_device(slots, self.last_tokens.device)] = to_device(tokens, self.last_tokens.device)

    def read(self, launched: LaunchedStep) -> np.ndarray:
        """The launched step's host rows [B, 2 + 2n], one per sampled row (`launched.rows.sampled`),
        once the device has them: token, log-prob, n alternative ids, their n log-probs
        (`alternatives` makes a row's wanted ones of those)."""
        if launched.sampled is None:
            return np.zeros((0, 2))
        if launched.ready is not None:
            launched.ready.synchronize()
        return launched.sampled.numpy()


def alternatives(row: list[float], n: int, wanted: int) -> TopLogprobs | None:
    """A host row [token, logprob, n ids, n logprobs] → the first `wanted` alternatives; none a
    grammar forbids (-inf: a constrained row may allow fewer tokens than were asked for)."""
    if not wanted:
        return None
    pairs = zip(map(int, row[2 : 2 + wanted]), row[2 + n : 2 + n + wanted])
    return [(token, logprob) for token, logprob in pairs if logprob != -math.inf]


def draft_prefixes(rows: StepRows) -> list[list[int]] | None:
    """Per sampled row, the draft tokens before it (row j of a sequence's 1 + k sees j of them);
    None when no row has a draft."""
    if not rows.drafted:
        return None
    prefixes, previous, j = [], None, 0
    for _, seq in rows.sampled:
        j = j + 1 if seq is previous else 0
        previous = seq
        prefixes.append(seq.draft[:j])
    return prefixes
