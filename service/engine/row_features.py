"""Which optional sampling stages a request's rows use: predicates over its parameters, and the
flags one step's rows use together (one OR over the slot table's bits), by which the sampler and
the decoding controls skip what no row of a step needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.engine.types import SamplingParams


def uses_bias(p: SamplingParams) -> bool:
    return bool(p.logit_bias)


def uses_counts(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def uses_history(p: SamplingParams) -> bool:
    return p.no_repeat_ngram_size > 0 or bool(p.bad_words_ids)


def uses_min_new(p: SamplingParams) -> bool:
    return p.min_new_tokens > 0


def uses_warpers(p: SamplingParams) -> bool:
    # transformers applies min_p and typical_p only when sampling.
    return p.do_sample and (p.min_p > 0.0 or p.typical_p < 1.0)


def uses_none(p: SamplingParams) -> bool:
    """A request whose rows of these tables, at their neutral values, change nothing: no control,
    min_p and typical_p off (whether or not it samples)."""
    return not (uses_bias(p) or uses_counts(p) or uses_history(p) or uses_min_new(p)) and p.min_p == 0.0 and p.typical_p == 1.0


def features_of(p: SamplingParams) -> tuple[bool, ...]:
    """Which optional stage of the sampler a row uses, in RowFeatures' field order."""
    return (
        p.do_sample,
        p.do_sample and (p.top_k > 0 or p.top_p < 1.0),
        p.repetition_penalty != 1.0,
        uses_bias(p),
        uses_counts(p),
        uses_history(p),
        uses_min_new(p),
        uses_warpers(p),
        bool(p.bad_words_ids),
        p.grammar is not None,
    )


@dataclass(frozen=True)
class RowFeatures:
    """Whether any row of a step uses each optional stage (the sampler skips the others)."""

    sample: bool
    top_k_top_p: bool
    penalty: bool
    bias: bool
    counts: bool
    history: bool
    min_new: bool
    warpers: bool
    bad_words: bool
    grammar: bool
    max_ngram: int = 0  # the longest no_repeat_ngram_size among them
    top_logprobs: int = 0  # the most alternatives any of them asked for
    # Any decoding control (bias, counts, history, min_new, warpers): set once, read every step.
    controls: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "controls", self.bias or self.counts or self.history or self.min_new or self.warpers)


FEATURES = len(RowFeatures.__dataclass_fields__) - 3  # the flags, before max_ngram, top_logprobs, controls
HISTORY_BIT = 1 << list(RowFeatures.__dataclass_fields__).index("history")
PER_ROW_BIT = 1 << FEATURES  # the row needs Python of its own when its token is read (a drafter)
STOP_IDS_BIT = 1 << (FEATURES + 1)  # the row ends at stop token ids (read as an array operation)
ALTERNATIVES_BIT = 1 << (FEATURES + 2)  # the row asks for its alternatives (top log-probs)
# Stop token ids a row holds in the input batch's table (the HTTP schemas' bound); a request with
# more, possible only in-process, is read row by row.
MAX_STOP_IDS = 64
