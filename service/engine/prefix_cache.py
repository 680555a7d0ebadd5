"""What the KV cache still holds after its sequences finished, and which prompt can reuse it.

A free slot keeps the keys and values its last sequence wrote (positions 0..len(tokens)-1)
until the slot is given to a request that does not adopt it. An arriving prompt reuses the
longest common token prefix among those free slots (adopted in place: the slot becomes the
request's) and the slots of running sequences (copied into the request's own slot), so only the
rest of the prompt is prefilled. Like llama.cpp's `cache_prompt`, but across every slot.

Exactness: a slot's `tokens` are exactly the tokens whose keys and values were written by
forwards that completed (a sequence's `cached` count), so what is reused is what a cold prefill
would compute, up to the order of floating-point sums. A failed step forgets everything.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from model.lora import BASE
from service.engine.types import PromptScores


def common_prefix_length(a: list[int], b: list[int], limit: int | None = None) -> int:
    """How many leading tokens a and b share (at most `limit`); list slices compare in C, so
    this bisects."""
    low, high = 0, min(len(a), len(b), len(a) if limit is None else limit)
    if high == 0 or a[0] != b[0]:  # most candidates differ at once: no slices made
        return 0
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


@dataclass
class ScoredPrefix:
    """Prompt scores known for a slot's tokens: entry i scores tokens[i] (entry 0 is None)."""

    scores: PromptScores
    alternatives: int  # how many top alternatives each entry holds

    @property
    def length(self) -> int:
        return len(self.scores.logprobs)

    def head(self, count: int, alternatives: int) -> PromptScores:
        """The first `count` entries with `alternatives` alternatives each (new lists)."""
        s = self.scores
        top = [t if t is None else t[:alternatives] for t in s.top[:count]]
        return PromptScores(list(s.logprobs[:count]), list(s.ranks[:count]), top)


@dataclass
class Retained:
    tokens: list[int]
    scored: ScoredPrefix | None
    last_used: int  # a logical clock: the least recently used retained slot is evicted first
    adapter: int = BASE  # the LoRA adapter that computed its keys: only its own prompts reuse them


@dataclass
class PrefixMatch:
    """Where an admitted prompt's first `length` tokens' keys and values come from."""

    length: int
    slot: int | None  # a free slot holding them, taken over in place
    source: object | None  # else a running sequence (the caller's object), copied from
    scores: PromptScores | None = None  # entries 0..length when the request scores its prompt

    @property
    def adopt(self) -> bool:
        return self.slot is not None


def reusable_length(
    prompt: list[int], tokens: list[int], scored: ScoredPrefix | None, alternatives: int | None,
    cached: int | None = None,
) -> int:
    """Prompt tokens whose cached keys and values can be reused.

    At least the last prompt token is always computed again: its logits choose the first new
    token. A request that scores its prompt (alternatives is not None) also needs, for every
    reused token i, the score of prompt[i] itself, which the cached position i-1 produced; so
    it reuses i < common only where that score was kept, with enough alternatives.
    `cached`: how many of `tokens` the slot holds (default all).
    """
    common = common_prefix_length(prompt, tokens, cached)
    if alternatives is None:
        return min(common, len(prompt) - 1)
    if scored is None or scored.alternatives < alternatives:
        return 0
    # Entry `length` (the first computed token's score) comes from the reused position length-1.
    return max(0, min(common - 1, len(prompt) - 1, scored.length - 1))


class PrefixCache:
    def __init__(self, enabled: bool, release: Callable[[int], object] | None = None) -> None:
        """`release`: gives a free slot's blocks back to the KV cache's pool, when what the slot
        held is forgotten (not when it is adopted or dropped to be overwritten: `drop`)."""
        self.enabled = enabled
        self.retained: dict[int, Retained] = {}  # free slot → what it still holds
        self._clock = 0
        self._release = release or (lambda slot: None)
        self.evictions = 0  # kept prefixes given up to make room (not those a failure forgot)

    def keep(self, slot: int, tokens: list[int], scored: ScoredPrefix | None, adapter: int = BASE) -> None:
        if self.enabled and tokens:
            self._clock += 1
            self.retained[slot] = Retained(tokens, scored, self._clock, adapter)

    def forget_adapter(self, adapter: int) -> None:
        """An adapter was unloaded: its index may be given to another, whose keys differ."""
        for slot in [slot for slot, kept in self.retained.items() if kept.adapter == adapter]:
            self.evict(slot)

    def drop(self, slot: int) -> None:
        """The slot is given to a sequence: what it held is adopted or about to be overwritten."""
        self.retained.pop(slot, None)

    def length(self, slot: int) -> int:
        kept = self.retained.get(slot)
        return len(kept.tokens) if kept else 0

    def evict(self, slot: int) -> None:
        """Forget what a free slot holds and give its blocks back."""
        self.evictions += slot in self.retained
        self.forget(slot)

    def forget(self, slot: int) -> None:
        self.retained.pop(slot, None)
        self._release(slot)

    def least_recently_used(self) -> list[int]:
        return sorted(self.retained, key=self._last_used)

    def clear(self) -> None:
        for slot in list(self.retained):
            self.forget(slot)

    def eviction_order(self, free_slots: list[int], count: int | None = None) -> list[int]:
        """Free slots, those holding nothing first, then least recently used first; only the
        first `count` of that order when given (no sort of every free slot per admission)."""
        key = lambda slot: (slot in self.retained, self._last_used(slot), slot)  # noqa: E731
        if count is None:
            return sorted(free_slots, key=key)
        return heapq.nsmallest(count, free_slots, key=key)  # sorted(...)[:count], documented so

    def _last_used(self, slot: int) -> int:
        kept = self.retained.get(slot)
        return kept.last_used if kept else 0

    def move(self, src: int, dst: int) -> None:
        """The retained contents of src now live in dst (a swap while packing)."""
        kept = self.retained.pop(src, None)
        if kept is not None:
            self.retained[dst] = kept

    def best_match(
        self,
        prompt: list[int],
        alternatives: int | None,
        running: list[tuple[object, list[int], int, ScoredPrefix | None]],
        adapter: int = BASE,
    ) -> PrefixMatch | None:
        """The longest reusable prefix among retained free slots and running sequences, given as
        (sequence, its tokens, how many its slot holds, their scores; only those starting with
        the prompt's first token and the same adapter need be given). Ties go to adopting in place.
        `adapter`: the prompt's LoRA adapter; keys another adapter computed are not reused."""
        if not self.enabled or not prompt:
            return None
        best: PrefixMatch | None = None
        first = prompt[0]
        # Filtered on the first token in these loops: with every slot full, each admission
        # looks at hundreds of candidates, and nearly all differ there (reusable length 0).
        candidates = [(slot, None, kept.tokens, None, kept.scored) for slot, kept in self.retained.items()
                      if kept.tokens[0] == first and kept.adapter == adapter]
        candidates += [(None, source, tokens, cached, scored) for source, tokens, cached, scored in running]
        for slot, source, tokens, cached, scored in candidates:
            length = reusable_length(prompt, tokens, scored, alternatives, cached)
            if length > 0 and (best is None or (length, slot is not None) > (best.length, best.adopt)):
                scores = scored.head(length + 1, alternatives) if alternatives is not None else None
                best = PrefixMatch(length, slot, source, scores)
        return best
