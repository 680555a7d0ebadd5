"""Reading a launched step's tokens on the host: each appended to its sequence, EOS, stop ids,
a grammar's end and length checked, drafts judged, ended sequences' slots freed, and the step's
tokens collected (as columns, StepTokens) for the HTTP side.

Every step is read as a batch, however it was laid out: its stops are array comparisons against
the rows' facts gathered from the input batch at launch (a grammar's rows add their matcher's
step); a drafter's rows are read on their own beside it (a draft's 1 + k rows together), and a
beam's by its search (service/engine/beams.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Protocol

import numpy as np

from service.engine.faults import NONFINITE, RowFault, grammar_failed, nonfinite
from service.engine.grammar import first_line
from service.engine.requests import RequestState, Sequence
from service.engine.speculation import kept_length
from service.engine.step_data import EOS, LAST, PROMPT_LENGTH, LaunchedStep, alternatives
from service.engine.types import CoreToken, FinishReason, RequestDone, RequestFailed, RequestStarted, StepTokens, TopLogprobs


@dataclass
class StepResults:
    """What postprocessing collects during one step, before it becomes a CoreStep."""

    tokens: StepTokens = field(default_factory=StepTokens)
    started: list[RequestStarted] = field(default_factory=list)
    done: list[RequestDone] = field(default_factory=list)
    # Requests whose own rows failed (faults.py): each ends alone, the rest of the step goes on.
    failed: list[RequestFailed] = field(default_factory=list)
    decode_output_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


class SequenceEnds(Protocol):
    """What the reader asks of the scheduler that owns it: to end sequences."""

    releases: int  # sequences ended so far

    def release_sequence(self, seq: Sequence, reason: FinishReason, state: RequestState) -> None: ...

    def end_failed(self, state: RequestState, scrub: bool = False) -> None: ...


class StepReader:
    def __init__(self, scheduler: SequenceEnds, eos_token_id: int) -> None:
        self.scheduler = scheduler
        self.eos_token_id = eos_token_id

    def read(self, launched: LaunchedStep, host: np.ndarray, results: StepResults) -> None:
        """Append each sequence's tokens (`host`: the sampler's rows, one per sampled row) and
        report them. The requests a sequence of which ended are added to `launched.ended`.

        One pass over the step's arrays: every row's stops (EOS, stop ids, a grammar's end, length)
        as array operations against the rows' facts gathered at launch; Python per row only to
        append a token to its sequence, and for the rows that end, ask for alternatives or have a
        grammar. A drafter's rows (a draft's 1 + k) and a beam's are read on their own first."""
        if launched.faults or (len(host) and not np.isfinite(host[:, 1]).all()):  # a failing step alone
            self._fail_faulty(launched, host)
        facts, sampled = launched.rows.facts, launched.rows.sampled
        tokens, logprobs, counters, table = host[:, 0].astype(np.int64), host[:, 1], facts.counters, facts.table
        request_ids, indexes, stop_ids, wanted = facts.request_ids, facts.indexes, facts.stop_ids, facts.wanted
        own, kept, stopped = facts.own, None, None
        if own:
            kept = self._read_own(launched, host, own, results)
        if facts.constrained:
            stopped = self._match(launched, sampled, tokens, facts.constrained, own)
        if launched.releases != self.scheduler.releases:  # a sequence ended since launch: one of these?
            alive = np.fromiter((seq.finish_reason is None for _, seq in sampled), dtype=bool, count=len(sampled))
            if kept is not None:
                alive[own] = True  # read above, whatever became of them
            if not alive.all():
                kept = alive if kept is None else kept & alive
        rows = None  # the host rows kept, when some were dropped
        if kept is not None:
            rows = keep = np.flatnonzero(kept)
            tokens, logprobs, counters, table = tokens[keep], logprobs[keep], counters[keep], table[keep]
            # The lists by runs of kept rows (slices, no Python per row): a few rows of their own
            # or ended among many.
            runs = true_runs(kept)
            sampled, request_ids, indexes = picked(sampled, runs), picked(request_ids, runs), picked(indexes, runs)
            stop_ids = stop_ids[keep] if stop_ids is not None else None
            wanted = picked(wanted, runs) if wanted is not None else None
            stopped = stopped[keep] if stopped is not None else None
        eos = tokens == table[:, EOS]
        if stopped is not None:  # a complete grammar allows nothing more: it ends as EOS does
            eos |= stopped
        if stop_ids is not None:  # a stop token id ends a sequence as EOS does
            eos |= (tokens[:, None] == stop_ids).any(axis=1)
        ends = np.flatnonzero(eos | (counters >= table[:, LAST])).tolist()
        token_ids = tokens.tolist()
        for (_, seq), token in zip(sampled, token_ids):
            ids = seq.token_ids
            ids.append(token)
            seq.cached = len(ids) - 1  # the forward that chose it wrote every earlier token
        out = results.tokens  # its columns extended here: every step runs this
        offset = len(out.token_ids)
        for i in ends:
            state, seq = sampled[i]
            out.reasons[offset + i] = reason = "eos_token" if eos[i] else "length"
            self.scheduler.release_sequence(seq, reason, state)
            launched.ended.append(state)
        out.request_ids += request_ids
        out.indexes += indexes
        out.token_ids += token_ids
        out.logprobs += logprobs.tolist()
        if wanted is not None:  # alternatives: Python for the rows that asked, the rest untouched
            n = launched.alternatives
            for i, count in enumerate(wanted):
                if count:
                    out.top[offset + i] = alternatives(host[i if rows is None else rows[i]].tolist(), n, count)
        results.decode_output_tokens += int(np.count_nonzero(counters > table[:, PROMPT_LENGTH]))  # not a prompt's first

    def _fail_faulty(self, launched: LaunchedStep, host: np.ndarray) -> None:
        """End the requests of the rows that failed: a grammar's mask at launch, or logits that
        were not finite (their log-probability is NaN or infinite: faults.py). Their rows are
        then skipped like those of any sequence that ended since launch."""
        bad = np.flatnonzero(~np.isfinite(host[:, 1])).tolist()
        faults = dict(launched.faults)
        for row in bad:
            _, seq = launched.rows.sampled[row]
            faults.setdefault(row, nonfinite(len(seq.token_ids) - seq.prompt_length + 1))
        for row, fault in sorted(faults.items()):
            state, seq = launched.rows.sampled[row]
            if seq.finish_reason is None:  # else it ended since launch, and this row is moot
                self.fail(state, fault, launched)

    def fail(self, state: RequestState, fault: RowFault, launched: LaunchedStep) -> None:
        """The request ends with `fault`: every sequence of it leaves now (the core then answers
        it: RequestFailed)."""
        self.scheduler.end_failed(state, scrub=fault.cause == NONFINITE)
        launched.failed.append((state, fault))

    def _match(self, launched: LaunchedStep, sampled: list, tokens: np.ndarray, constrained: list[int],
               own: list[int] | None) -> np.ndarray:
        """A batch's constrained rows (but those read on their own): each grammar takes its row's
        token first, and a token it refuses fails its request (the row is then dropped as one
        ended since launch). [B]: True where the grammar is complete."""
        stopped = np.zeros(len(sampled), dtype=bool)
        skip = set(own) if own else ()
        for i in constrained:
            state, seq = sampled[i]
            if i in skip or seq.finish_reason is not None:
                continue
            if (error := refusal(seq.matcher, tokens[i].item())) is not None:
                self.fail(state, grammar_failed(error), launched)
            elif seq.matcher.is_stopped():
                stopped[i] = True
        return stopped

    def _read_own(self, launched: LaunchedStep, host: np.ndarray, own: list[int], results: StepResults) -> np.ndarray:
        """Read the rows of their own (a draft's 1 + k rows together); [B]: False for them."""
        sampled = launched.rows.sampled
        kept = np.ones(len(sampled), dtype=bool)
        kept[own] = False
        after = 0  # the row after the last one read
        for i in own:
            if i < after:
                continue
            state, seq = sampled[i]
            after = i + 1 + len(seq.draft)
            # Ended (or cancelled) since its step was launched: nothing to read. A beam's search
            # reads the step (service/engine/beams.py), not its draw.
            if seq.finish_reason is None and state.beam is None:
                self._read_sequence(launched, state, seq, host[i:after].tolist(), results)
        return kept

    def _read_sequence(self, launched: LaunchedStep, state: RequestState, seq: Sequence, rows: list[list[float]],
                       results: StepResults) -> None:
        """One sequence's rows of the step (1 + k with a draft of k)."""
        n = launched.alternatives
        if not seq.draft and seq.drafter is None:  # one token, no draft to judge
            row = rows[0]
            token = self._advance(state, seq, row, alternatives(row, n, state.params.top_logprobs) if n else None, launched)
            if token is not None:
                results.tokens.append(token)
                if token[4] is not None:  # its finish reason
                    launched.ended.append(state)
            results.decode_output_tokens += len(seq.token_ids) - 1 > seq.prompt_length
            return
        draft, decoding = seq.draft, len(seq.token_ids) > seq.prompt_length
        keep = kept_length([int(row[0]) for row in rows], draft)
        emitted = 0
        for row in rows[:keep]:
            top = alternatives(row, n, state.params.top_logprobs) if n else None
            token = self._advance(state, seq, row, top, launched)
            if token is None:  # its grammar failed: the request has ended
                break
            results.tokens.append(token)
            emitted += 1
            if seq.finish_reason is not None:
                launched.ended.append(state)
                break
        if decoding:
            results.decode_output_tokens += emitted
            results.draft_tokens += len(draft)
            results.accepted_tokens += emitted - 1
            if seq.drafter is not None:
                seq.acceptance.record(len(draft), keep - 1)
        seq.draft = []

    def _advance(
        self, state: RequestState, seq: Sequence, row: list[float], top: TopLogprobs | None, launched: LaunchedStep,
    ) -> CoreToken | None:
        """Append the token of a sampler's row (`row`: [token, log-prob, ...]) and check its
        stops. None: the request failed on it (its grammar could not take it)."""
        token = int(row[0])
        if seq.matcher is not None and (error := refusal(seq.matcher, token)) is not None:
            self.fail(state, grammar_failed(error), launched)
            return None
        seq.token_ids.append(token)
        seq.cached = len(seq.token_ids) - 1  # the forward that chose it wrote every earlier token
        params = state.request.params
        if (token == self.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
            reason = "eos_token"
        elif seq.matcher is not None and seq.matcher.is_stopped():
            reason = "eos_token"  # the grammar is complete and allows nothing more: EOS is all it could add
        elif len(seq.token_ids) - seq.prompt_length >= params.max_new_tokens:
            reason = "length"
        else:
            reason = None
        if reason is not None:
            self.scheduler.release_sequence(seq, reason, state)
        return (state.request.request_id, seq.index, token, row[1], reason, top)


def refusal(matcher, token: int) -> str | None:
    """None when the grammar's matcher takes `token`; else why not: its error (never a grammar
    that ended: llguidance's stopped state includes errors), or what it raised (llguidance raises
    only on misuse; still the request's alone)."""
    try:
        if matcher.consume_token(token):
            return None
        return first_line(matcher.get_error()) or f"token {token} was not allowed"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def true_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) runs of True in a boolean [B] mask."""
    if not len(mask):
        return []
    bounds = [0, *(np.flatnonzero(mask[1:] != mask[:-1]) + 1).tolist(), len(mask)]  # where the value changes
    first = 0 if mask[0] else 1
    return list(zip(bounds[first::2], bounds[first + 1 :: 2]))


def picked(column: list, runs: list[tuple[int, int]]) -> list:
    """The items of `column` in `runs` (true_runs), in order."""
    return list(chain.from_iterable(column[start:end] for start, end in runs))
