"""Which KV blocks are free, how many rows hold each, and which hold a known prefix.

A block holding a full run of positions whose keys and values a completed forward computed can
be registered under a key naming its content (the engine's prefix cache chains it over the
block's tokens and every token before them: service/engine/prefix_cache.py). Any number of rows
then hold it read only (its refcount); when the last lets go it stays registered, free but
cached, until the pool needs a block and nothing uncached is free: then the least recently freed
cached block is evicted (its key dropped). vLLM v1's block pool and nano-vllm's block manager
work so. A row wanting a particular cached free block (model/kv_cache.py's homes) has it moved
out of the way first (`relocate`) while an uncached block is free.

Block 0 is the scratch block (model/kv_cache.py), never handed out.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Hashable

import numpy as np


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refs = np.zeros(num_blocks + 1, dtype=np.int64)  # rows holding each block
        # Free blocks holding nothing anyone can find: a set, and a heap (lowest first) that may
        # still list blocks taken out of turn, skipped when popped.
        self._free: set[int] = set(range(1, num_blocks + 1))
        self._heap: list[int] = list(range(1, num_blocks + 1))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # free and registered, least recently freed first
        self.key_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}
        self.evictions = 0  # cached blocks given up for a block the pool needed
        # Blocks a row can take, cached or not: a count kept as blocks come and go, since every
        # step reads it (the step's stats).
        self.free_count = num_blocks
        # Told each key the pool drops (evicted or forgotten), so what is kept beside it goes too.
        self.on_drop: Callable[[Hashable], None] = lambda key: None

    @property
    def cached_free_count(self) -> int:
        return len(self._cached_free)

    def take(self, wanted: int | None = None, evict_wanted: bool = False) -> int:
        """A free block for a row to write: `wanted` where it is free and uncached (or cached
        and `evict_wanted`), else the lowest uncached one, else the least recently freed cached
        one, evicted. The caller checked `free_count`."""
        if wanted is not None and (wanted in self._free or (evict_wanted and wanted in self._cached_free)):
            block = wanted
        elif self._free:
            block = heapq.heappop(self._heap)
            while block not in self._free:  # taken out of turn earlier
                block = heapq.heappop(self._heap)
        else:
            block = next(iter(self._cached_free))
        if block in self._cached_free:
            del self._cached_free[block]
            self.evictions += 1
            self._drop_key(block)
        else:
            self._free.remove(block)
        self.refs[block] = 1
        self.free_count -= 1
        return block

    def relocate(self, block: int) -> int | None:
        """Move a cached free block's key to the lowest uncached free block, which the caller
        fills with a copy of its content; the block is then plainly free. Where a row wants that
        very block (its home), the cache keeps what it held, as least-recently-freed eviction
        would, instead of giving it up. None (nothing moved) when the block is not cached free or
        no uncached block is free. The moved entry counts as freed now."""
        if block not in self._cached_free or not self._free:
            return None
        spare = heapq.heappop(self._heap)
        while spare not in self._free:  # taken out of turn earlier
            spare = heapq.heappop(self._heap)
        self._free.remove(spare)
        del self._cached_free[block]
        self._cached_free[spare] = None
        key = self.key_of.pop(block)
        self.key_of[spare], self._block_of[key] = key, spare
        self._free.add(block)
        heapq.heappush(self._heap, block)
        return spare

    def hold(self, blocks: Iterable[int]) -> None:
        """One more row holds each block (a cached free one is taken out of the free blocks)."""
        for block in blocks:
            if self.refs[block] == 0:
                del self._cached_free[block]
                self.free_count -= 1
            self.refs[block] += 1

    def let_go(self, blocks: list[int]) -> list[int]:
        """One row fewer holds each block; returns those no row holds any more. A registered one
        stays cached, the later in `blocks` the sooner evicted (a sequence's last blocks are the
        least likely shared)."""
        freed = []
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block]:
                continue
            freed.append(block)
            self.free_count += 1
            if block in self.key_of:
                self._cached_free[block] = None
            else:
                self._free.add(block)
                heapq.heappush(self._heap, block)
        if len(self._heap) > 2 * self.num_blocks:  # stale entries outnumber the pool
            self._heap = sorted(self._free)
        freed.reverse()
        return freed

    def register(self, block: int, key: Hashable) -> None:
        """The block holds what `key` names; a key already registered keeps its block."""
        if key not in self._block_of and block not in self.key_of:
            self._block_of[key] = block
            self.key_of[block] = key

    def lookup(self, key: Hashable) -> int | None:
        return self._block_of.get(key)

    def forget(self, blocks: Iterable[int]) -> None:
        """Drop the blocks' keys (what they hold must not be found again); a free one is then
        plainly free."""
        for block in blocks:
            if block not in self.key_of:
                continue
            self._drop_key(block)
            if block in self._cached_free:
                del self._cached_free[block]
                self._free.add(block)
                heapq.heappush(self._heap, block)

    def forget_all(self) -> None:
        self.forget(list(self.key_of))

    def _drop_key(self, block: int) -> None:
        key = self.key_of.pop(block)
        del self._block_of[key]
        self.on_drop(key)
