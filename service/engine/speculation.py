"""Speculative decoding from n-gram drafts: which sequences draft, and how much of a draft stands.

A sequence with a draft d1..dk feeds [last token, d1..dk] in one forward and gets logits at each
of the 1 + k positions. The sampler then draws at every position exactly as plain decoding would
have drawn there (the same logits processors and, for seeded sampling, the same counter-based
uniform number: the one of the sequence's length at that position), and the draft stands up to
the first position whose drawn token differs from it; that drawn token is kept too. So the
tokens are the ones decoding without speculation gives, greedy or seeded, not merely tokens
from the same distribution (the usual rejection-sampling guarantee).

Controls that read the tokens before a position (repetition, presence and frequency penalties,
no_repeat_ngram_size, bad_words_ids) are kept per slot and updated once per step; a sequence
that uses them does not speculate. Beam search does not speculate either. A constrained
sequence's draft is cut where its grammar would refuse a token, and each of its 1 + k rows is
masked by the grammar as it stands after the draft tokens before that row.

How many tokens a sequence drafts each step (0 to k) is draft_policy.py's: as many as its recent
acceptance makes worth their rows at the step's batch size.
"""

from __future__ import annotations

import logging

from service.engine.draft_policy import acceptance_threshold, draft_length
from service.engine.ngram_drafter import NgramIndex, NgramSettings
from service.engine.requests import RequestState, Sequence
from service.engine.types import SamplingParams

log = logging.getLogger(__name__)


def speculates(params: SamplingParams) -> bool:
    return (
        params.speculate
        and params.num_beams == 1
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.no_repeat_ngram_size == 0
        and not params.bad_words_ids
    )


def new_drafter(settings: NgramSettings | None, params: SamplingParams) -> NgramIndex | None:
    return NgramIndex(settings) if settings is not None and speculates(params) else None


def propose(states: list[RequestState], settings: NgramSettings, rows: int) -> list[Sequence]:
    """Give each sequence of `states` (the decoding requests that may draft: the scheduler passes
    the host-paced ones, so no Python runs over the others) this step's draft (empty where it has
    none or none pays); the sequences with one.

    `rows`: the step's rows before drafts, what a draft token is priced against: one per running
    sequence and one per prompt token prefilled beside them.
    """
    threshold = acceptance_threshold(rows, settings.weight_pass_rows)
    drafted = []
    for state in states:
        for seq in state.live:
            if seq.drafter is None:
                continue
            # The step makes at most 1 + k tokens; draft none past max_new_tokens.
            room = state.params.max_new_tokens - len(seq.generated) - 1
            most = min(room, draft_length(seq.acceptance.rate, threshold, settings.tokens))
            try:
                seq.draft = seq.drafter.draft(seq.token_ids, most) if most > 0 else []
                seq.acceptance.looked(bool(seq.draft) or most == 0, len(seq.token_ids))
                if seq.draft and seq.matcher is not None:  # only what the grammar allows is worth a row
                    seq.draft = seq.draft[: seq.matcher.validate_tokens(seq.draft)]
            except Exception:
                # A draft only saves forwards: the sequence whose drafting failed decodes on
                # without drafts (the same tokens), and no other request notices.
                log.exception("drafting for request %s failed; it goes on without drafts", state.request.request_id)
                seq.draft, seq.drafter = [], None
                continue
            if seq.draft:
                drafted.append(seq)
    return drafted


def needing_host_tokens(states: list[RequestState], settings: NgramSettings | None, rows: int,
                        alone: bool) -> list[RequestState]:
    """Of host-paced requests whose last token is in flight (overlap), those that need it on the
    host before their next step, and so sit that step out: a beam search; a sequence verifying a
    draft in the step in flight (its length is known once that step is read); one that would
    draft from that token (`DraftAcceptance.wants_to_look`, at a step of `rows`; `alone`: no other
    row would run in that step). The others decode as plain rows, fed from the device, with no
    draft."""
    threshold = acceptance_threshold(rows, settings.weight_pass_rows) if settings is not None else 0.0
    return [state for state in states if state.beam is not None or any(
        seq.draft or (seq.drafter is not None and seq.acceptance.wants_to_look(threshold, settings.tokens, alone,
                                                                             len(seq.token_ids) + seq.pending))
        for seq in state.live)]


def kept_length(drawn: list[int], draft: list[int]) -> int:
    """How many of the 1 + k drawn tokens stand: through the first that differs from the draft."""
    for position, token in enumerate(draft):
        if drawn[position] != token:
            return position + 1
    return len(draft) + 1
