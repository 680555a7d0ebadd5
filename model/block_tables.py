"""The KV cache's bookkeeping on the host: which rows are in use, which blocks each row holds,
and which rows share a block (model/kv_cache.py keeps the keys and values these index).

A *row* (a "slot" in the engine's words) is a running sequence's index in the batch: what the
input batch and the sampler index by. Its keys and values live in blocks of BLOCK_SIZE positions
taken from one pool as it grows (vLLM's PagedAttention, nano-vllm's block manager), so memory
goes to tokens that exist, not to rows × the full context. The pool's size is a memory budget.

Block 0 is a scratch block, never given to a row: a row's table entries beyond its own blocks
point at it, so padded decode rows (service/engine/graphs.py) write there and a batch's reads of
positions past a row's length (masked, or sliced off) stay inside the pool.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

import numpy as np

from model.block_pool import BlockPool

# Positions per block. Measured on the CPU (docs/engine.md, "KV cache"): gathering one layer of
# 16 rows × 512 positions of GPT-2 124M took 56, 51, 52 and 47 ms with blocks of 8, 16, 32 and
# 64 (within this machine's noise); 16 wastes least in a partial block (vLLM's default too).
BLOCK_SIZE = 16
SCRATCH = 0  # the block unallocated table entries point at


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-tokens // block_size)


class BlockTables:
    """Rows and their block tables over a pool of `num_blocks` blocks (default: max_slots rows of
    max_len positions, the bytes a cache of fixed slots took). What moves keys and values
    (`_copy_blocks`: a copy on write, a row's home taken from a cached block) is the cache's."""

    def __init__(self, max_slots: int, max_len: int, num_blocks: int | None, block_size: int, shared_tables: bool) -> None:
        """`shared_tables`: the device reads the host's tables themselves (the CPU), where reads
        are views and rows get homes."""
        if max_slots < 1:
            raise ValueError(f"max_slots must be at least 1, got {max_slots}")
        self.block_size = block_size
        self.blocks_per_row = blocks_for(max_len, block_size)
        num_blocks = max_slots * self.blocks_per_row if num_blocks is None else num_blocks
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks  # usable blocks, the scratch block not counted
        self.max_slots = max_slots
        self.max_len = max_len
        # A heap so the lowest free row is reused first: running rows stay packed at the bottom,
        # which keeps most decode batches one span.
        self._free: list[int] = list(range(max_slots))
        self._used: set[int] = set()
        self.in_use = np.zeros(max_slots, dtype=bool)  # the same as a mask, for array operations
        # Block tables: row r's i-th block, SCRATCH where it has none. On the host, where the
        # scheduler edits them; the device copy is refreshed before a forward reads it.
        self.tables = np.full((max_slots, self.blocks_per_row), SCRATCH, dtype=np.int64)
        self.row_blocks = np.zeros(max_slots, dtype=np.int64)  # blocks each row holds
        self._shared_tables = shared_tables
        self._tables_stale = False  # the device's copy is behind the host's tables
        self._moves: dict[int, int] = {}  # destination block → source: cached blocks moved, not yet copied
        # Free blocks, blocks kept for the prefix they hold, and how many rows hold each:
        # several share a prompt's blocks (read only; one that writes into a shared block first
        # copies it: `writable`).
        self.pool = BlockPool(num_blocks)
        self.refs = self.pool.refs
        # Where reads are views (the CPU) and the pool holds every row at full length, row r
        # prefers the blocks a fixed slot r had (its home): rows running side by side then read as
        # one view, as slots did. Those bytes are the row's: growing into its home, it has a cached
        # block lying there moved aside (`_take_home`), and a row starting from cached blocks
        # takes copies there (`share`), since a row holding others' blocks is gathered every step.
        # On a GPU every read gathers: blocks are taken in turn, cached ones evicted in LRU order.
        self.homes = shared_tables and num_blocks >= max_slots * self.blocks_per_row
        self._views_version = 0  # counts the tables' changes: a view found before one is stale

    # --- rows -----------------------------------------------------------------------------------
    @property
    def slots_used(self) -> int:
        return len(self._used)

    @property
    def slots_free(self) -> int:
        return len(self._free)

    @property
    def usage_ratio(self) -> float:
        return len(self._used) / self.max_slots

    def allocate(self, count: int = 1, tokens: int | None = None) -> list[int]:
        """The lowest free rows, each with blocks for `tokens` positions (default max_len: a
        row that holds a whole sequence, as a caller writing positions directly expects)."""
        if count > len(self._free):
            raise RuntimeError(f"KV cache full: asked for {count} rows, {len(self._free)} free")
        tokens = self.max_len if tokens is None else tokens
        if count * blocks_for(tokens, self.block_size) > self.blocks_free:
            raise RuntimeError(f"KV cache full: {count} rows of {tokens} positions need more than the "
                               f"{self.blocks_free} free blocks")
        slots = [heapq.heappop(self._free) for _ in range(count)]
        self._used.update(slots)
        self.in_use[slots] = True
        for slot in slots:
            self.ensure(slot, tokens)
        return slots

    @property
    def packed(self) -> bool:
        """The rows in use are 0..slots_used-1: no free row below a used one."""
        return not self._free or self._free[0] >= len(self._used)

    def free(self, slots: list[int] | int) -> None:
        """Give rows back, and their blocks (those registered stay cached in the pool)."""
        for slot in [slots] if isinstance(slots, int) else slots:
            if slot not in self._used:
                raise RuntimeError(f"slot {slot} is not in use")
            self._used.remove(slot)
            self.in_use[slot] = False
            heapq.heappush(self._free, slot)
            self.release(slot)

    # --- blocks ---------------------------------------------------------------------------------
    @property
    def blocks_free(self) -> int:
        """Blocks a row can take, cached ones (evicted when taken) included."""
        return self.pool.free_count

    def blocks_of(self, slot: int) -> list[int]:
        return self.tables[slot, : self.row_blocks[slot]].tolist()

    def ensure(self, slot: int, tokens: int) -> bool:
        """Give the row blocks for its first `tokens` positions; False (nothing taken) when the
        pool has too few free blocks. The next block is the row's home block where the pool has
        homes, else the one after the row's last, where free: a row growing alone stays one run
        (read as a view)."""
        needed = blocks_for(min(tokens, self.max_len), self.block_size) - int(self.row_blocks[slot])
        if needed <= 0:
            return True
        if needed > self.pool.free_count:
            return False
        held = int(self.row_blocks[slot])
        previous = int(self.tables[slot, held - 1]) if held else None
        for index in range(held, held + needed):
            if self.homes:
                block = self._take_home(self._home(slot, index))
            else:
                block = self.pool.take(previous + 1 if previous is not None else None)
            self.tables[slot, index] = previous = block
        self.row_blocks[slot] = held + needed
        self._tables_changed()
        return True

    def release(self, slot: int) -> list[int]:
        """Let go of every block the row holds; those no other row holds go back to the pool
        (returned), registered ones cached there."""
        held = self.blocks_of(slot)
        blocks = self.pool.let_go(held)
        self.tables[slot] = SCRATCH
        self.row_blocks[slot] = 0
        if held:
            self._tables_changed()
        return blocks

    def fork(self, src: int, dst: int, tokens: int) -> None:
        """Row dst (holding no blocks) shares row src's blocks for its first `tokens` positions:
        several samples of one prompt hold the prompt once."""
        if self.row_blocks[dst]:
            raise RuntimeError(f"row {dst} still holds blocks")
        count = min(blocks_for(tokens, self.block_size), int(self.row_blocks[src]))
        self.tables[dst, :count] = self.tables[src, :count]
        self.row_blocks[dst] = count
        self.refs[self.tables[src, :count]] += 1
        self._tables_changed()

    def share(self, slot: int, blocks: list[int]) -> None:
        """Row `slot` (holding no blocks) starts with these blocks, read only: cached ones
        holding its prefix (model/block_pool.py), which it holds from now on. Where rows have
        homes (where decode reads views: the CPU), the row takes copies in its home blocks instead:
        the bytes are its own anyway, and a row whose blocks are one run is read as a view every
        step, where a row holding another row's blocks is gathered every step, layer by layer."""
        if self.row_blocks[slot]:
            raise RuntimeError(f"row {slot} still holds blocks")
        if self.homes and len(blocks) <= self.pool.free_count:
            blocks = self._copied_home(slot, blocks)
        else:
            self.pool.hold(blocks)
        self.tables[slot, : len(blocks)] = blocks
        self.row_blocks[slot] = len(blocks)
        self._tables_changed()

    def _copied_home(self, slot: int, blocks: list[int]) -> list[int]:
        """The row's first home blocks, holding copies of `blocks` (those lying there already
        held as they are). One copy of all: every source is read before any block is written,
        so a source taken as another's destination (evicted from the cache) is still copied whole."""
        mine, sources, copies = [], [], []
        for index, block in enumerate(blocks):
            if block == self._home(slot, index):
                self.pool.hold([block])
                mine.append(block)
                continue
            mine.append(self._take_home(self._home(slot, index)))
            sources.append(block)
            copies.append(mine[-1])
        if copies:
            self._copy_blocks(sources, copies)
        return mine

    def _home(self, slot: int, index: int) -> int:
        """Row `slot`'s index-th home block: the one a fixed slot's cache gave that position."""
        return 1 + slot * self.blocks_per_row + index

    def _take_home(self, block: int) -> int:
        """A row's home block, or another free one where a row holds it. A prefix cached there
        is moved to a free block first where one is (a copy of one block), else evicted: the
        row's bytes are its own, and a row in its home blocks is read as a view."""
        spare = self.pool.relocate(block)
        if spare is not None:
            # Queued, copied before the next forward or copy (`sync_tables`): one copy a step,
            # however many rows grew. A block moved before its own move was copied holds what
            # its source held, and needs no copy of its own now.
            self._moves[spare] = self._moves.pop(block, block)
        return self.pool.take(block, evict_wanted=True)

    def register(self, slot: int, index: int, key: Hashable) -> None:
        """The row's index-th block, whose positions a completed forward wrote, holds what `key`
        names: a later row may share it."""
        if index < self.row_blocks[slot]:
            self.pool.register(int(self.tables[slot, index]), key)

    def writable(self, slot: int, start: int, end: int) -> bool:
        """Make the row's blocks holding positions [start, end) its own: a shared one is copied
        into a new block first (copy on write). False (nothing changed) when the pool has too few
        free blocks."""
        first, last = start // self.block_size, min(blocks_for(end, self.block_size), int(self.row_blocks[slot]))
        shared = [index for index in range(first, last) if self.refs[self.tables[slot, index]] > 1]
        if not shared:
            return True
        if len(shared) > self.pool.free_count:
            return False
        old = self.tables[slot, shared].tolist()
        # Into the row's home blocks where free, as `ensure` grows it: the row stays one run (a view).
        new = [self._take_home(self._home(slot, index)) if self.homes else self.pool.take()
               for index in shared]
        self.refs[old] -= 1
        self.tables[slot, shared] = new
        self._tables_changed()
        self._copy_blocks(old, new)
        return True

    def share_rows(self, sources: list[int], rows: list[int], lengths: list[int]) -> bool:
        """Row rows[i] lets its blocks go and holds row sources[i]'s first lengths[i] positions
        instead (a beam continuing another): the full blocks shared, the partial last one, which
        the row writes into next, copied (one copy for all). No row of `rows` is a source or
        twice there. `release` and `fork` row by row, and the copy `writable` would make, with
        one pass over the pool for the blocks let go; a step has a few such rows, for which a
        handful of slices each cost the host less than arrays over them all.
        False (nothing changed) when the pool may have too few free blocks for the copies."""
        size, tables, row_blocks, refs = self.block_size, self.tables, self.row_blocks, self.refs
        spans = []  # per row: its source's blocks it shares, and whether it copies the next one
        for source, length in zip(sources, lengths):
            full, held = length // size, int(row_blocks[source])
            spans.append((min(full, held), full * size < length and full < held))
        if sum(copied for _, copied in spans) > self.pool.free_count:
            return False
        old, copy_from, copy_to = [], [], []
        for source, row, (shared, copied) in zip(sources, rows, spans):
            old += tables[row, : row_blocks[row]].tolist()
            blocks = tables[source, :shared]
            refs[blocks] += 1  # held by their source row: none is free (and none twice in a row)
            tables[row, :shared] = blocks
            if copied:
                copy_from.append(int(tables[source, shared]))
                copy_to.append(self.pool.take())
                tables[row, shared] = copy_to[-1]
            tables[row, shared + copied:] = SCRATCH
            row_blocks[row] = shared + copied
        self.pool.let_go(old)
        self._tables_changed()
        if copy_to:
            self._copy_blocks(copy_from, copy_to)
        return True

    def move_row(self, src: int, dst: int) -> None:
        """Row src's blocks become row dst's and dst's become src's: a packing move is a table
        move, no key or value is copied."""
        self.tables[[src, dst]] = self.tables[[dst, src]]
        self.row_blocks[[src, dst]] = self.row_blocks[[dst, src]]
        self._tables_changed()


    def _tables_changed(self) -> None:
        self._views_version += 1
        if not self._shared_tables:
            self._tables_stale = True


    def _copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Block dst[i] holds what block src[i] holds (the cache's keys and values)."""
        raise NotImplementedError
