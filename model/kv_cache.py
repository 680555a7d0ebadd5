"""Key/value cache as a pool of fixed-size blocks, each running sequence's row a block table.

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
from dataclasses import dataclass

import numpy as np
import torch

from model.block_pool import BlockPool
from model.config import GPT2Config
from model.paged_attention import check_decode_attention, paged_decode
from model.transfer import to_device

# Positions per block. Measured on the CPU (docs/engine.md, "KV cache"): gathering one layer of
# 16 rows × 512 positions of GPT-2 124M took 56, 51, 52 and 47 ms with blocks of 8, 16, 32 and
# 64 (within this machine's noise); 16 wastes least in a partial block (vLLM's default too).
BLOCK_SIZE = 16
SCRATCH = 0  # the block unallocated table entries point at


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-tokens // block_size)


def bytes_per_token(config: GPT2Config, dtype: torch.dtype) -> int:
    """Keys and values of one position in every layer."""
    return 2 * config.n_layer * config.n_embd * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class SlotBatch:
    """The rows one forward pass reads and writes, row b of the batch being row ids[b].

    `span` is set when the rows are consecutive: the host then knows which they are without a
    device read, and attention may read their blocks through a view (`KVCache.read`).
    """

    ids: torch.Tensor  # [B] long, on the cache's device
    span: slice | None


@dataclass(frozen=True)
class RowReads:
    """Where each row's first `lengths[b]` positions lie, found once per forward for every layer
    (`KVCache.row_reads`): a run of the pool's position axis from `starts[b]` (read as a view),
    or, where the row's blocks are not consecutive (starts[b] None), blocks gathered[firsts[b]:]
    of one gather for all such rows."""

    lengths: list[int]
    starts: list[int | None]
    firsts: list[int]  # where a gathered row's blocks begin in `gathered`
    gathered: torch.Tensor | None  # [blocks] long: the blocks of every row not one run, row after row


class KVCache:
    """Keys and values for `max_slots` rows of up to `max_len` positions, in `num_blocks` blocks.

    Layout [n_layer, 2, n_head, block·position, head_dim]: block b of a head is the run of
    positions b·BLOCK_SIZE..(b+1)·BLOCK_SIZE-1, so a row whose blocks are consecutive is one
    [n_head, length, head_dim] view, the shape scaled_dot_product_attention reads, and a gather
    of any rows copies whole blocks. Keys and values are the two halves of `kv`, so a layer's new
    keys and values are stored by one indexed copy, straight from the QKV projection's output.

    `num_blocks` defaults to max_slots full-length rows (the bytes a cache of fixed slots took).
    """

    def __init__(
        self,
        config: GPT2Config,
        max_slots: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        num_blocks: int | None = None,
        block_size: int = BLOCK_SIZE,
        decode_attention: str = "gather",
    ) -> None:
        if not 1 <= max_len <= config.n_positions:
            raise ValueError(f"max_len must be in [1, {config.n_positions}], got {max_len}")
        if max_slots < 1:
            raise ValueError(f"max_slots must be at least 1, got {max_slots}")
        check_decode_attention(decode_attention, torch.device(device))
        self.decode_attention = decode_attention  # a CUDA decode step's reads (model/paged_attention.py)
        self.block_size = block_size
        self.blocks_per_row = blocks_for(max_len, block_size)
        num_blocks = max_slots * self.blocks_per_row if num_blocks is None else num_blocks
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks  # usable blocks, the scratch block not counted
        shape = (config.n_layer, 2, config.n_head, (num_blocks + 1) * block_size, config.head_dim)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)
        self.keys, self.values = self.kv.unbind(1)  # views: [n_layer, n_head, block·position, head_dim]
        self.by_block = self.kv.view(*shape[:3], num_blocks + 1, block_size, config.head_dim)  # what copies index
        self.head_dim = config.head_dim
        self._gathered = self.kv.new_empty(0)  # what `read` gathers into (valid until the next read)
        self.max_slots = max_slots
        self.max_len = max_len
        self.device = torch.device(device)
        # A heap so the lowest free row is reused first: running rows stay packed at the bottom,
        # which keeps most decode batches one span.
        self._free: list[int] = list(range(max_slots))
        self._used: set[int] = set()
        self.in_use = np.zeros(max_slots, dtype=bool)  # the same as a mask, for array operations
        # Block tables: row r's i-th block, SCRATCH where it has none. On the host, where the
        # scheduler edits them; the device copy is refreshed before a forward reads it.
        self.tables = np.full((max_slots, self.blocks_per_row), SCRATCH, dtype=np.int64)
        self.row_blocks = np.zeros(max_slots, dtype=np.int64)  # blocks each row holds
        self._shared_tables = self.device.type == "cpu"  # the device copy is the host array itself
        self.device_tables = torch.from_numpy(self.tables) if self._shared_tables else to_device(self.tables, self.device)
        self._tables_stale = False
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
        self.homes = self._shared_tables and num_blocks >= max_slots * self.blocks_per_row
        self._views: dict[tuple[int, int, int], tuple[int, int] | None] = {}  # (first row, rows, blocks) → view
        self._views_version = 0
        self._views_at = -1

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

    def sync_tables(self) -> None:
        """Bring the device up to date with the scheduler's changes: the cached blocks it moved
        (`_take_home`) copied, and the host's tables copied to the device (CUDA) when they
        changed, queued behind the work already launched (which reads the old ones), from pinned
        memory, so the host does not wait for it (model/transfer.py). Every forward runs this
        before it writes or reads; a captured graph does not: whoever replays one calls it."""
        if self._moves:
            moves, self._moves = self._moves, {}
            self._copy_now(list(moves.values()), list(moves))
        if self._tables_stale:
            self.device_tables.copy_(to_device(self.tables, self.device), non_blocking=True)
            self._tables_stale = False

    # --- tensors ----------------------------------------------------------------------------------
    def batch(self, slots: list[int], ids: torch.Tensor | None = None) -> SlotBatch:
        """`ids`: the rows as a tensor on the device already (copied there with other inputs)."""
        if ids is None:
            ids = to_device(slots, self.device)
        consecutive = all(b == a + 1 for a, b in zip(slots, slots[1:]))
        span = slice(slots[0], slots[-1] + 1) if slots and consecutive else None
        return SlotBatch(ids=ids, span=span)

    def write_index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each (row, position)'s place in the pool's position axis (slots and positions [B, T] or
        [N]): the same for every layer of a forward, which finds it once (`AttentionInputs`)."""
        self.sync_tables()
        blocks = self.device_tables[slots, positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def write(self, layer: int, index: torch.Tensor, kv: torch.Tensor) -> None:
        """Store kv [..., 2, H, d_h] (keys, then values) at the places `index` [...] (`write_index`)."""
        self.kv[layer][:, :, index] = kv.movedim((-3, -2), (0, 1))  # [2, H, ..., d_h]

    def read(self, layer: int, rows: SlotBatch, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `length` positions of each row: [B, H, length, d_h].

        A view where the rows' blocks lie as a fixed-size slot cache's would (each row one run
        of blocks, the runs evenly spaced: a lone row grown alone, most often), else one gather
        of the rows' blocks (valid until the next read). Either way the same numbers."""
        blocks = blocks_for(length, self.block_size)
        view = self._view(rows.span, blocks) if rows.span is not None else None
        if view is not None:
            first, row_stride = view
            keys, values = self.keys[layer], self.values[layer]  # [H, N, d_h]
            size = (rows.span.stop - rows.span.start, keys.shape[0], length, keys.shape[2])
            strides = (row_stride * self.block_size * keys.stride(1), keys.stride(0), keys.stride(1), keys.stride(2))
            offset = first * self.block_size * keys.stride(1)
            return (keys.as_strided(size, strides, keys.storage_offset() + offset),
                    values.as_strided(size, strides, values.storage_offset() + offset))
        self.sync_tables()
        table = self.device_tables[rows.span if rows.span is not None else rows.ids, :blocks]  # [B, nb]
        out = self._gather_blocks(layer, table.reshape(-1))  # [2H, B·nb, block_size·d_h]
        H, B = self.kv.shape[2], table.shape[0]
        gathered = out.view(2, H, B, -1, self.head_dim).transpose(1, 2)[:, :, :, :length]  # [2, B, H, length, d_h]
        return gathered[0], gathered[1]

    def attend_decode(self, layer: int, q: torch.Tensor, rows: SlotBatch, lengths: torch.Tensor, scale: float) -> torch.Tensor:
        """One query per row, q [B, H, d_h], over the row's first lengths[b] positions, read from
        its blocks in place ("paged" decode attention): [B, H, d_h]."""
        self.sync_tables()
        tables = self.device_tables[rows.span if rows.span is not None else rows.ids]  # [B, blocks per row]
        return paged_decode(q, self.kv[layer], tables, lengths, scale, self.block_size)

    def row_reads(self, rows: SlotBatch, lengths: list[int]) -> RowReads:
        """Where each row's first lengths[b] positions are. Each row is looked at alone, so a row
        whose blocks are not where a batch view wants them (a packing move carried its table, it
        adopted a kept prefix or copied a shared block on write) is still a view if its own
        blocks are one run, and else costs a gather of its own blocks, not of the batch's."""
        slots = np.arange(rows.span.start, rows.span.stop) if rows.span is not None else rows.ids.cpu().numpy()
        lengths = list(lengths[: len(slots)])
        counts = -(-np.asarray(lengths, dtype=np.int64) // self.block_size)  # [B] blocks each row reads
        columns = np.arange(int(counts.max()) if len(counts) else 0)
        table = self.tables[slots[:, None], columns[None, :]]  # [B, most blocks]
        # Consecutive blocks from the first, up to the row's count (past it, whatever lies there).
        runs = ((table - table[:, :1] == columns) | (columns >= counts[:, None])).all(axis=1)  # [B]
        starts: list[int | None] = (table[:, 0] * self.block_size).tolist()
        firsts = [0] * len(starts)
        scattered = np.flatnonzero(~runs).tolist()
        gathered = []
        for b in scattered:
            starts[b], firsts[b] = None, sum(len(blocks) for blocks in gathered)
            gathered.append(table[b, : counts[b]])
        index = torch.from_numpy(np.concatenate(gathered)).to(self.device) if gathered else None
        return RowReads(lengths, starts, firsts, index)

    def _gather_blocks(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """The layer's blocks listed, keys' and values' heads first: [2H, len(blocks), block_size·d_h],
        valid until the next gather. Into a buffer kept between reads: a fresh tensor of this size
        costs more in page faults than the copy itself."""
        by_block = self.kv[layer].view(-1, self.num_blocks + 1, self.block_size * self.head_dim)  # [2H, blocks, ·]
        size = by_block.shape[0] * blocks.numel() * by_block.shape[2]
        if self._gathered.numel() < size:
            self._gathered = by_block.new_empty(size)
        out = self._gathered[:size].view(by_block.shape[0], blocks.numel(), -1)
        return torch.index_select(by_block, 1, blocks, out=out)

    def read_rows(self, layer: int, reads: RowReads) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Row b's keys, and its values, of its first reads.lengths[b] positions, [1, H, length, d_h]
        each: the numbers `read` gives, for rows attended one by one (CPU decode). Gathered rows
        are valid until the next read."""
        kv = self.kv[layer]  # [2, H, block·position, d_h]
        H = kv.shape[1]
        if reads.gathered is not None:
            out = self._gather_blocks(layer, reads.gathered)  # [2H, blocks, block_size·d_h]
        keys, values = [], []
        # A run's keys and values as one as_strided each: the slicing it replaces was about ten
        # dispatches a row and layer, 192 rows × layers a step at 16 rows.
        strides, key_offset = (kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3)), kv.storage_offset()
        value_offset, position = key_offset + kv.stride(0), kv.stride(2)
        for start, first, length in zip(reads.starts, reads.firsts, reads.lengths):
            if start is not None:
                size = (1, H, length, self.head_dim)
                keys.append(kv.as_strided(size, strides, key_offset + start * position))
                values.append(kv.as_strided(size, strides, value_offset + start * position))
                continue
            count = -(-length // self.block_size)
            row = out[:, first : first + count].view(2, H, count * self.block_size, self.head_dim)
            keys.append(row[0:1, :, :length])
            values.append(row[1:2, :, :length])
        return keys, values

    def _view(self, span: slice, blocks: int) -> tuple[int, int] | None:
        """(first block, blocks between rows) when rows span's first `blocks` blocks can be read
        as one strided view; None when they must be gathered. Only on the CPU, where nothing is
        captured: a CUDA graph must not bake in a view of blocks that later change hands."""
        if not self._shared_tables:
            return None
        if self._views_at != self._views_version:
            self._views.clear()
            self._views_at = self._views_version
        key = (span.start, span.stop, blocks)
        if key not in self._views:
            self._views[key] = self._find_view(self.tables[span, :blocks])  # [rows, blocks]
        return self._views[key]

    def _find_view(self, table: np.ndarray) -> tuple[int, int] | None:
        """Each row's blocks one run, the runs' starts evenly spaced. Past its own blocks (SCRATCH
        entries) a row's view reads the blocks its run would continue into, as a fixed slot read
        its stale positions: only positions past the row's length, which attention slices off
        or masks."""
        starts = table[:, 0]
        if (starts == SCRATCH).any():
            return None
        runs = table - table[:, :1]  # each row's blocks minus its first
        if not ((runs == np.arange(table.shape[1])) | (table == SCRATCH)).all():
            return None
        first = int(starts[0])
        stride = int(starts[1] - starts[0]) if len(starts) > 1 else 0
        if stride < 0 or not (starts == first + stride * np.arange(len(starts))).all():
            return None
        if int(starts[-1]) + table.shape[1] > self.num_blocks + 1:  # a run would leave the pool
            return None
        return first, stride

    def scrub(self, blocks: list[int]) -> None:
        """Zero blocks (and the scratch block): a failed sequence's keys and values may not be
        finite, and a later sequence's masked positions still multiply them (0 * NaN is NaN)."""
        self.sync_tables()  # a block moved out of one of these holds what it held before
        self.by_block[:, :, :, [SCRATCH, *blocks]] = 0

    def copy_slots(self, src: list[int], dst: list[int], length: int) -> None:
        """Make row dst[i] hold what src[i] holds in its first `length` positions (beam
        reordering), on the device; the dst rows hold blocks for them."""
        if not src:
            return
        count = blocks_for(length, self.block_size)
        src_blocks = self.tables[src, :count].reshape(-1)
        dst_blocks = self.tables[dst, :count].reshape(-1)
        if (dst_blocks == SCRATCH).any() or (src_blocks == SCRATCH).any():
            raise RuntimeError(f"copy_slots: rows {src} → {dst} do not all hold {length} positions")
        self._copy_blocks(src_blocks.tolist(), dst_blocks.tolist())

    def _copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.sync_tables()  # the queued moves first: a source may be a block moved to
        self._copy_now(src, dst)

    def _copy_now(self, src: list[int], dst: list[int]) -> None:
        src_ids, dst_ids = to_device([src, dst], self.device).unbind()  # unbind: no Tensor.__iter__
        by_block = self.by_block
        # The source blocks are gathered first, so a permutation among the same blocks is safe;
        # index_copy_ (dst distinct) costs the host about half an index_put on this view.
        by_block.index_copy_(3, dst_ids, by_block.index_select(3, src_ids))
