"""Draft tokens from the sequence itself: prompt lookup, as vLLM's `ngram`, TGI's `--speculate`,
llama.cpp's `ngram` drafts and transformers' `prompt_lookup_num_tokens` do.

For the last n tokens of a sequence (n from `max_n` down to `min_n`, longest first) find their
latest earlier occurrence in the prompt and output, and propose the (up to) k tokens that
followed it (past the sequence's end, the copy repeats itself: a loop's draft goes round it). An index per sequence maps each n-gram to where its latest occurrence ended, and
grows by `max_n - min_n + 1` entries per token, so drafting costs a few dictionary look-ups per
sequence per step whatever the length (bench/bench_speculative.py measures it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class NgramSettings:
    min_n: int = 1
    max_n: int = 3
    tokens: int = 4  # k: the most tokens a sequence drafts in one step
    # Rows a forward adds for the price of one pass over the weights: what prices a draft token
    # against the batch (draft_policy.py). math.inf: every sequence drafts k tokens whenever it can.
    weight_pass_rows: float = 16.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes need 1 <= min <= max, got {self.min_n}..{self.max_n}")
        if self.tokens < 1:
            raise ValueError(f"speculative tokens must be at least 1, got {self.tokens}")
        if not self.weight_pass_rows > 0:
            raise ValueError(f"weight_pass_rows must be positive, got {self.weight_pass_rows}")


def continuation(tokens: list[int], start: int, count: int) -> list[int]:
    """`count` tokens copied from `start` on, the copy reading its own output past the end (an
    overlapping copy, as LZ77's): a sequence in a loop of period p matches p tokens back, and its
    draft goes on round the loop rather than stopping after p tokens."""
    draft = tokens[start : start + count]
    overlap = len(tokens) - start  # tokens between the match and the end: the loop's period
    while len(draft) < count:
        draft.append(draft[len(draft) - overlap])
    return draft


@dataclass
class NgramIndex:
    """One sequence's n-gram → end of its latest occurrence that some token follows."""

    settings: NgramSettings
    latest: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # occurrences ending at or before this position are in `latest`

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) tokens to propose after `tokens` (the sequence so far)."""
        self._catch_up(tokens)
        count = min(self.settings.tokens, limit)
        if count < 1:
            return []
        for n in range(min(self.settings.max_n, len(tokens) - 1), self.settings.min_n - 1, -1):
            end = self.latest.get(tuple(tokens[-n:]))
            if end is not None:
                return continuation(tokens, end, count)
        return []

    def _catch_up(self, tokens: list[int]) -> None:
        # An occurrence ending at `end` is usable once a token follows it (end < len(tokens)), so
        # the n-grams ending at the last token join only after it has a successor.
        # Per n, the n-grams ending at each new position as one zip of n shifted slices (no
        # Python per token: a new sequence indexes its whole prompt), later ends overwriting.
        low, high = self.settings.min_n, self.settings.max_n
        start, stop = max(self.indexed + 1, low), len(tokens)
        for n in range(low, high + 1):
            first = max(start, n)
            if first < stop:
                grams = zip(*(tokens[first - n + j : stop - n + j] for j in range(n)))
                self.latest.update(zip(grams, range(first, stop)))
        self.indexed = max(self.indexed, stop - 1)

    def copy(self) -> NgramIndex:
        return NgramIndex(self.settings, dict(self.latest), self.indexed)
