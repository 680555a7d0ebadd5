"""The sampling stage of a step: the draw over a step's logits with its rows' parameters and
controls (gathered from the input batch), and the one device→host copy of what it drew.

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
from service.engine.beams import launch_candidates
from service.engine.faults import NonfiniteInjection, grammar_failed
from service.engine.grammar import Grammars
from service.engine.input_batch import InputBatch
from service.engine.requests import RequestState
from service.engine.step_data import LaunchedBeams, LaunchedStep, StepRows


class StepSampler:
    def __init__(self, batch: InputBatch, grammars: Grammars | None, injection: NonfiniteInjection | None = None) -> None:
        self.batch = batch
        self.grammars = grammars
        self.injection = injection  # chaos tests only (faults.py)

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
        slot_params, slot_controls = self.batch.params, self.batch.controls
        params = slot_params.gather(read, features)
        params.controls = slot_controls.gather(read, rows.sample_counters, features)
        seen = slot_params.seen(read) if params.any_penalty else None
        step_logits = logits[: len(rows.sampled)] if rows.in_slot_order else logits[rows.sample_rows]  # [B, V]
        if self.injection is not None:
            step_logits = self.injection.apply(
                step_logits, [(state.params.seed, len(seq.token_ids) + seq.pending - seq.prompt_length) for state, seq in rows.sampled])
        faults = {}
        if features.grammar:
            # The grammar's forbidden tokens at -inf before anything reads the logits: the
            # sampler, the log-probabilities and the alternatives see the constrained
            # distribution. Unconstrained rows are untouched (their values, their bits).
            # The mask is built for the constrained rows alone, not [B, V].
            constrained, banned, errors = self.grammars.banned([seq.matcher for _, seq in rows.sampled],
                                                               step_logits.device, draft_prefixes(rows))
            index = to_device(constrained, step_logits.device)
            step_logits = step_logits.index_put((index,), step_logits[index].masked_fill(banned, float("-inf")))
            faults = {row: grammar_failed(error) for row, error in errors.items()}
        tokens, logprobs = choose_tokens(step_logits, params, rows.sample_counters, seen)  # [B], [B]
        if params.any_penalty:
            slot_params.mark_seen(slots, tokens)
        slot_controls.record(params.controls, slots, rows.sample_counters, tokens)
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
        drawn = torch.cat(columns, dim=1)
        candidates = launch_candidates(step_logits, rows.beams) if rows.beams else None  # [R, 1 + 3k]
        if candidates is not None:  # the beam searches' candidates ride the same copy
            host = torch.cat([drawn.reshape(-1), candidates.reshape(-1)]).to("cpu", non_blocking=True)
        else:
            host = drawn.to("cpu", non_blocking=True)
        ready = None
        if host.device != logits.device and logits.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        if candidates is None:
            return LaunchedStep(rows, active, completing, host, n, ready, deferred, faults=faults)
        sampled, beams = host.split([drawn.numel(), candidates.numel()])
        return LaunchedStep(rows, active, completing, sampled.view(drawn.shape), n, ready, deferred, faults=faults,
                            beams=LaunchedBeams(rows.beams, beams.view(candidates.shape), step_logits.shape[-1]))

    def _alternatives(self, step_logits: torch.Tensor, wanted: list[int], n: int) -> torch.Tensor:
        """[B, 2n]: the n most likely ids and their log-probs for the rows that asked (`wanted`: each
        row's count), zeros for the others: the top-n over the vocabulary runs on those rows alone.
        Both functions work row by row, so a row's alternatives do not depend on its neighbours."""
        asked = [row for row, count in enumerate(wanted) if count]
        if len(asked) == len(wanted):
            top_ids, top_logprobs = top_alternatives(step_logits.float(), n)  # [B, n], [B, n]
            return torch.cat([top_ids.double(), top_logprobs.double()], dim=1)
        index = to_device(asked, step_logits.device)
        top_ids, top_logprobs = top_alternatives(step_logits[index].float(), n)  # [k, n], [k, n]
        out = torch.zeros(len(wanted), 2 * n, dtype=torch.float64, device=step_logits.device)
        out[index] = torch.cat([top_ids.double(), top_logprobs.double()], dim=1)
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
