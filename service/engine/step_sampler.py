"""The sampling stage of a step: the draw over a step's logits with its rows' parameters and
controls (gathered from the input batch with the layout), and the one device→host copy of what it
drew.

`launch` queues the draw and the copy and returns at once (on CUDA the host goes on while the
device works: the engine core's overlap); `read` waits for the copy and returns the tokens.
The sampler also leaves each slot's token in the batch's `last_tokens` on the device, which the
next step's decode feeds when the host has not read it yet.
"""

from __future__ import annotations

import numpy as np
import torch

from model.sampling import choose_tokens
from model.scoring import top_alternatives
from model.transfer import to_device
from service.engine.beams import candidates_width, launch_candidates
from service.engine.faults import NonfiniteInjection, grammar_failed
from service.engine.grammar import Grammars
from service.engine.input_batch import InputBatch
from service.engine.requests import RequestState, Sequence
from service.engine.step_data import LaunchedBeams, LaunchedStep, StepRows


class StepSampler:
    def __init__(self, batch: InputBatch, grammars: Grammars | None, injection: NonfiniteInjection | None = None) -> None:
        self.batch = batch
        self.grammars = grammars
        self.injection = injection  # chaos tests only (faults.py)

    def launch(
        self, logits: torch.Tensor, rows: StepRows, active: list[RequestState], completing: list[RequestState],
        deferred: bool = False, waited: LaunchedStep | None = None,
    ) -> LaunchedStep:
        """Queue the sampling of every sampled row and the copy of its results to the host.
        `deferred`: the tokens will be read after the next step is launched (no drafts then).

        A constrained row whose last token is still in flight (the core's overlap) needs that token
        in its matcher before its mask: the draw then waits (`awaiting`) until the core has read
        the step before, and `draw` queues it (`waited`: that step). The forwards are queued
        meanwhile, so the masks are computed while the device runs them, and the row never sits a
        step out."""
        launched = waited or LaunchedStep(rows, active, completing, None, 0, None, deferred)
        if not rows.sampled:
            return launched
        if waited is None:
            if self.injection is not None:  # keyed by each row's draw, known now
                launched.injected = [(state.params.seed, len(seq.token_ids) + seq.pending - seq.prompt_length)
                                     for state, seq in rows.sampled]
            if rows.facts.features.grammar and any(seq.pending for seq in constrained_sequences(rows)):
                launched.awaiting = logits
                return launched
        launched.awaiting = None
        slots, read = rows.sample_slots, rows.read
        features, params = rows.facts.features, rows.facts.sampling
        step_logits = logits[: len(rows.sampled)] if rows.logits_in_order else logits[rows.sample_rows]  # [B, V]
        if self.injection is not None:
            step_logits = self.injection.apply(step_logits, launched.injected)
        faults = {}
        if features.grammar:
            # The grammar's forbidden tokens at -inf before anything reads the logits: the
            # sampler, the log-probabilities and the alternatives see the constrained
            # distribution. Unconstrained rows are untouched (their values, their bits).
            # The mask is built for the constrained rows alone, not [B, V], and they are found
            # from the input batch (RowFacts.constrained), not by a pass over every row.
            # A sequence that ended while its draw waited (`awaiting`) is masked by nothing.
            sampled = rows.sampled
            constrained = [row for row in candidate_rows(rows)
                           if sampled[row][1].matcher is not None and sampled[row][1].finish_reason is None]
            _, banned, errors = self.grammars.banned([sampled[row][1].matcher for row in constrained],
                                                     step_logits.device, draft_prefixes(rows, constrained))
            index = to_device(constrained, step_logits.device)
            step_logits = step_logits.index_put((index,), step_logits[index].masked_fill(banned, float("-inf")))
            faults = {constrained[at]: grammar_failed(error) for at, error in errors.items()}
        tokens, logprobs = choose_tokens(step_logits, params, rows.sample_counters, rows.facts.seen)  # [B], [B]
        if params.any_penalty or params.controls is not None:
            self.batch.record(params, slots, rows.sample_counters, tokens)
        # The next step's inputs; a drafted sequence's (several rows on one slot) is set once its
        # step is read (it sits out the steps before), so no slot is written twice in one step.
        if rows.drafted:
            undrafted = to_device(rows.undrafted, tokens.device)
            self.batch.last_tokens[slots[undrafted]] = tokens[undrafted]
        else:
            self.batch.last_tokens[read] = tokens
        columns = [tokens[:, None].double(), logprobs[:, None].double()]
        # Alternatives: as many as the most demanding row asked for; each row keeps its own count.
        n = features.top_logprobs
        if n:
            columns.append(self._alternatives(step_logits, rows.facts.wanted, n))
        # The sampler's one device→host copy: tokens, their log-probs and alternatives together
        # (float64 holds every token id exactly). [B, 2 + 2n]. Queued, not waited for: on CUDA
        # the host goes on (non_blocking lands in pinned memory) and `read` waits for the event.
        if rows.beams:  # the beam searches' candidates ride the same copy, written beside the rows
            shape = (len(tokens), sum(column.shape[1] for column in columns))
            size = shape[0] * shape[1]
            both = torch.empty(size + len(rows.beams) * candidates_width(rows.beams), dtype=torch.float64,
                               device=tokens.device)
            torch.cat(columns, dim=1, out=both[:size].view(shape))
            candidates = launch_candidates(step_logits, rows.beams, both[size:].view(len(rows.beams), -1))
            host = both.to("cpu", non_blocking=True)  # views of the host's copy (on a CPU, of `both`)
            launched.sampled = host[:size].view(shape)
            launched.beams = LaunchedBeams(rows.beams, host[size:].view(candidates.shape), step_logits.shape[-1])
        else:
            launched.sampled = host = torch.cat(columns, dim=1).to("cpu", non_blocking=True)
        launched.alternatives, launched.faults = n, faults
        if host.device != logits.device and logits.device.type == "cuda":
            launched.ready = torch.cuda.Event()
            launched.ready.record()
        return launched

    def draw(self, launched: LaunchedStep) -> None:
        """Queue the draw of a launched step that waited for the step before it to be read."""
        self.launch(launched.awaiting, launched.rows, launched.active, launched.completing, launched.deferred, launched)

    def _alternatives(self, step_logits: torch.Tensor, wanted: list[int], n: int) -> torch.Tensor:
        """[B, 2n]: the n most likely ids and their log-probs for the rows that asked (`wanted`: each
        row's count), zeros for the others: the top-n over the vocabulary runs on those rows alone.
        Both functions work row by row, so a row's alternatives do not depend on its neighbours."""
        # float32 (joined with the float64 columns by `launch`'s cat): it holds the log-probs and
        # every token id (below 2^24) exactly, and the ids need no conversion of their own.
        asked = [row for row, count in enumerate(wanted) if count]
        if len(asked) == len(wanted):
            return torch.cat(top_alternatives(step_logits.float(), n), dim=1)  # [B, n] ids, [B, n] log-probs
        index = to_device(asked, step_logits.device)
        out = torch.zeros(len(wanted), 2 * n, dtype=torch.float32, device=step_logits.device)
        out[index] = torch.cat(top_alternatives(step_logits[index].float(), n), dim=1)  # [k, 2n]
        return out

    def read(self, launched: LaunchedStep) -> np.ndarray:
        """The launched step's host rows [B, 2 + 2n], one per sampled row (`launched.rows.sampled`),
        once the device has them: token, log-prob, n alternative ids, their n log-probs
        (`alternatives` makes a row's wanted ones of those)."""
        if launched.sampled is None:
            return np.zeros((0, 2))
        if launched.ready is not None:
            launched.ready.synchronize()
        return launched.sampled.numpy()


def candidate_rows(rows: StepRows) -> list[int] | range:
    """The sampled rows that may be constrained: a batch's constrained rows, every row of a step
    laid out row by row."""
    return rows.facts.constrained if rows.facts.constrained is not None else range(len(rows.sampled))


def constrained_sequences(rows: StepRows) -> list[Sequence]:
    return [seq for seq in (rows.sampled[row][1] for row in candidate_rows(rows)) if seq.matcher is not None]


def draft_prefixes(rows: StepRows, picks: list[int]) -> list[list[int]] | None:
    """For the sampled rows `picks` (ascending; a drafted sequence's rows all or none), the draft
    tokens before each (row j of a sequence's 1 + k sees j of them); None when no row has a draft."""
    if not rows.drafted:
        return None
    prefixes, previous, j = [], None, 0
    for row in picks:
        seq = rows.sampled[row][1]
        j = j + 1 if seq is previous else 0
        previous = seq
        prefixes.append(seq.draft[:j])
    return prefixes
