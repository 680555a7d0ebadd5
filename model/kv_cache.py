"""Key/value cache as a pool of fixed-size blocks, each running sequence's row a block table:
the keys and values and how a forward writes and reads them (model/block_tables.py keeps which
rows hold which blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model.block_tables import BLOCK_SIZE, SCRATCH, BlockTables, blocks_for
from model.config import GPT2Config
from model.paged_attention import check_decode_attention, paged_decode
from model.transfer import to_device

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



class KVCache(BlockTables):
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
        check_decode_attention(decode_attention, torch.device(device))
        self.decode_attention = decode_attention  # a CUDA decode step's reads (model/paged_attention.py)
        self.device = torch.device(device)
        # On the CPU the device's tables are the host's array itself.
        super().__init__(max_slots, max_len, num_blocks, block_size, shared_tables=self.device.type == "cpu")
        shape = (config.n_layer, 2, config.n_head, (self.num_blocks + 1) * block_size, config.head_dim)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)
        self.keys, self.values = self.kv.unbind(1)  # views: [n_layer, n_head, block·position, head_dim]
        self.by_block = self.kv.view(*shape[:3], self.num_blocks + 1, block_size, config.head_dim)  # what copies index
        self.head_dim = config.head_dim
        self._gathered = self.kv.new_empty(0)  # what `read` gathers into (valid until the next read)
        self.device_tables = torch.from_numpy(self.tables) if self._shared_tables else to_device(self.tables, self.device)
        self._views: dict[tuple[int, int, int], tuple[int, int] | None] = {}  # (first row, rows, blocks) → view
        self._views_at = -1

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
