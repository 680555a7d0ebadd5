"""Prefix caching by block content: which cached KV blocks an arriving prompt can share.

Each full block (BLOCK_SIZE positions) a completed forward wrote is registered in the KV cache's
block pool (model/block_pool.py) under a key chained over its content: a digest of the key of
the block before it, its own tokens and the LoRA adapter that computed it. Equal keys mean
equal tokens at every position up to the block's end, under the same weights, hence the same
keys and values. An arriving prompt walks its full blocks' keys and shares every block found,
read only, until the first miss (vLLM's and nano-vllm's scheme): any number of running and
finished sequences' prompts are then held once. Running sequences register their prompt's
blocks as each prefill chunk is scheduled (their `cached` count), so requests sharing a system
prompt share it while it runs; generated tokens' blocks are registered as the sequence leaves
(finished, cancelled or preempted). Free registered blocks stay cached until the pool needs the
room, least recently freed first.

What is reused: whole blocks, and at least the last prompt token is computed (its logits choose
the first new token), so a prompt of n tokens reuses at most 16·⌊(n-1)/16⌋.

Prompt scores (echo, prompt_logprobs): entry i scores prompt[i] from position i-1. A block's
entries i (its 16 positions) depend only on tokens up to its end, so they are kept by its key;
entry 16·j (scored from the last reused position) depends on the next token too, so it is kept
by (key of block j-1, that token). A request scoring its prompt reuses a block only where those
are known with at least the alternatives it asks for.

A sequence that failed forgets its blocks' keys (what they hold may be what failed); a failed
step forgets every key; an unloaded adapter's keys are forgotten (its index may be reused).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from model.kv_cache import KVCache
from model.lora import BASE
from service.engine.types import PromptScores

if TYPE_CHECKING:  # requests.py's types, which import nothing from here at run time
    from service.engine.requests import RequestState, Sequence

ROOT = b""  # the parent key of a sequence's first block
Entry = tuple  # one prompt score entry: (log-probability, rank, top alternatives)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share; list slices compare in C, so this bisects."""
    low, high = 0, min(len(a), len(b))
    if high == 0 or a[0] != b[0]:  # most candidates differ at once: no slices made
        return 0
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def block_key(parent: bytes, tokens: list[int], adapter: int) -> bytes:
    """The key of a block holding `tokens` after the prefix `parent` names. A 128-bit BLAKE2b
    digest: Python's hash() of a tuple would do as well but for collisions, which would hand a
    prompt another prompt's keys."""
    data = b"".join(t.to_bytes(4, "little") for t in tokens)
    return hashlib.blake2b(parent + adapter.to_bytes(4, "little", signed=True) + data, digest_size=16).digest()


@dataclass
class BlockScores:
    """Prompt scores kept for a registered block: entries 16i..16i+15 of the prompts holding it,
    and entry 16i+16 by the token that follows it."""

    alternatives: int  # top alternatives each entry holds
    entries: list[Entry]
    next: dict[int, Entry] = field(default_factory=dict)


@dataclass
class PrefixMatch:
    """The cached blocks an admitted prompt shares: its first `length` tokens' keys and values."""

    blocks: list[int]
    keys: list[bytes]
    length: int
    scores: PromptScores | None = None  # entries 0..length when the request scores its prompt


class PrefixCache:
    def __init__(self, enabled: bool, cache: KVCache) -> None:
        self.enabled = enabled
        self.cache = cache
        self.block_size = cache.block_size
        self._scores: dict[bytes, BlockScores] = {}
        self._adapter_keys: dict[bytes, int] = {}  # keys an adapter's weights computed
        cache.pool.on_drop = self._dropped

    @property
    def evictions(self) -> int:
        """Cached blocks evicted to make room."""
        return self.cache.pool.evictions

    def match(self, tokens: list[int], alternatives: int | None, adapter: int = BASE,
              samples: bool = True) -> PrefixMatch | None:
        """The cached blocks holding the longest reusable prefix of `tokens`. `alternatives`:
        None when the request does not score its prompt, else the alternatives it wants.
        `samples`: the prefill samples from its last token, which is then always computed (a
        preempted sequence's does not: its tokens may all be reused)."""
        if not self.enabled:
            return None
        size, pool = self.block_size, self.cache.pool
        blocks, keys = [], []
        parent = ROOT
        for index in range((len(tokens) - samples) // size):
            key = block_key(parent, tokens[index * size : (index + 1) * size], adapter)
            block = pool.lookup(key)
            if block is None or (alternatives is not None and not self._scored(key, alternatives)):
                break
            blocks.append(block)
            keys.append(key)
            parent = key
        scores = None
        if alternatives is not None:
            while keys and self._boundary(keys, tokens, alternatives) is None:
                blocks.pop()
                keys.pop()
            if keys:
                scores = self._prompt_scores(keys, tokens, alternatives)
        if not blocks:
            return None
        return PrefixMatch(blocks, keys, len(blocks) * size, scores)

    def register(self, seq: Sequence, tokens: int) -> None:
        """Register the sequence's full blocks within its first `tokens` positions (written by
        forwards scheduled before, which later steps are queued behind), keying each."""
        if not self.enabled:
            return
        size, keys, ids = self.block_size, seq.block_keys, seq.token_ids
        for index in range(len(keys), min(tokens, len(ids)) // size):
            key = block_key(keys[-1] if keys else ROOT, ids[index * size : (index + 1) * size], seq.adapter)
            keys.append(key)
            self.cache.register(seq.slot, index, key)
            if seq.adapter != BASE and self.cache.pool.lookup(key) is not None:  # (dropped with it)
                self._adapter_keys[key] = seq.adapter

    def keep_scores(self, state: RequestState) -> None:
        """Keep the prompt scores a scoring request has computed so far by its registered
        blocks' keys, for later prompts sharing them."""
        scores = state.prompt_scores
        if not self.enabled or scores is None or not state.sequences:
            return
        size, pool, alternatives = self.block_size, self.cache.pool, state.params.top_logprobs
        prompt = state.request.prompt_ids
        keys = state.sequences[0].block_keys
        known = len(scores.logprobs)  # entries 0..known-1
        for index, key in enumerate(keys[: known // size]):
            if pool.lookup(key) is None:
                continue
            kept = self._scores.get(key)
            if kept is None or kept.alternatives < alternatives:
                entries = [self._entry(scores, i) for i in range(index * size, (index + 1) * size)]
                kept = self._scores[key] = BlockScores(alternatives, entries)
            after = (index + 1) * size
            if kept.alternatives == alternatives and after < known and after < len(prompt):
                kept.next.setdefault(prompt[after], self._entry(scores, after))

    def forget_blocks(self, blocks: list[int]) -> None:
        """What these blocks hold is not to be found again (a failed sequence's)."""
        self.cache.pool.forget(blocks)

    def forget_adapter(self, adapter: int) -> None:
        """An adapter was unloaded: its index may be given to another, whose keys differ."""
        pool = self.cache.pool
        blocks = [pool.lookup(key) for key, a in self._adapter_keys.items() if a == adapter]
        pool.forget([block for block in blocks if block is not None])

    def clear(self) -> None:
        self.cache.pool.forget_all()

    def _dropped(self, key: Hashable) -> None:
        self._scores.pop(key, None)
        self._adapter_keys.pop(key, None)

    def _scored(self, key: bytes, alternatives: int) -> bool:
        kept = self._scores.get(key)
        return kept is not None and kept.alternatives >= alternatives

    def _boundary(self, keys: list[bytes], tokens: list[int], alternatives: int) -> Entry | None:
        """Entry 16·len(keys): scored from the last reused position, of the token after it."""
        return self._scores[keys[-1]].next.get(tokens[len(keys) * self.block_size])

    def _prompt_scores(self, keys: list[bytes], tokens: list[int], alternatives: int) -> PromptScores:
        entries = [entry for key in keys for entry in self._scores[key].entries]
        entries.append(self._boundary(keys, tokens, alternatives))
        return PromptScores([e[0] for e in entries], [e[1] for e in entries],
                            [top if top is None else top[:alternatives] for _, _, top in entries])

    @staticmethod
    def _entry(scores: PromptScores, i: int) -> Entry:
        return scores.logprobs[i], scores.ranks[i], scores.top[i]
