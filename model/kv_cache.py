"""Preallocated key/value cache: fixed tensors, slots owned by sequences, written by index."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from model.config import GPT2Config
from model.transfer import to_device


@dataclass(frozen=True)
class SlotBatch:
    """The cache rows one forward pass reads and writes, row b of the batch using slot ids[b].

    `span` is set when the slots are consecutive, so attention can read the cache through a view
    instead of gathering rows (the gather would copy every cached key and value once per layer).
    """

    ids: torch.Tensor  # [B] long, on the cache's device
    span: slice | None


class KVCache:
    """Keys and values for `max_slots` sequences of up to `max_len` tokens.

    Layout [n_layer, slot, n_head, position, head_dim]: one slot's keys for one layer form a
    [n_head, position, head_dim] block, the shape scaled_dot_product_attention reads. Keys and
    values are the two halves of one tensor `kv` [2, n_layer, ...], so a layer's new keys and
    values are stored by one indexed copy, straight from the QKV projection's output.
    """

    def __init__(
        self,
        config: GPT2Config,
        max_slots: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not 1 <= max_len <= config.n_positions:
            raise ValueError(f"max_len must be in [1, {config.n_positions}], got {max_len}")
        if max_slots < 1:
            raise ValueError(f"max_slots must be at least 1, got {max_slots}")
        shape = (2, config.n_layer, max_slots, config.n_head, max_len, config.head_dim)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)
        self.keys, self.values = self.kv.unbind(0)  # views: [n_layer, slot, n_head, position, head_dim]
        self.max_slots = max_slots
        self.max_len = max_len
        self.device = torch.device(device)
        # A heap so the lowest free slot is reused first: running slots stay packed at the
        # bottom, which keeps most decode batches on the no-copy `span` path.
        self._free: list[int] = list(range(max_slots))
        self._used: set[int] = set()
        self.in_use = np.zeros(max_slots, dtype=bool)  # the same as a mask, for array operations

    # --- slot ownership -------------------------------------------------------------------
    @property
    def slots_used(self) -> int:
        return len(self._used)

    @property
    def slots_free(self) -> int:
        return len(self._free)

    @property
    def usage_ratio(self) -> float:
        return len(self._used) / self.max_slots

    def allocate(self, count: int = 1) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"KV cache full: asked for {count} slots, {len(self._free)} free")
        slots = [heapq.heappop(self._free) for _ in range(count)]
        self._used.update(slots)
        self.in_use[slots] = True
        return slots

    def claim(self, slot: int) -> None:
        """Take one particular free slot (one whose contents a new sequence reuses)."""
        if slot in self._used or not 0 <= slot < self.max_slots:
            raise RuntimeError(f"slot {slot} is not free")
        self._free.remove(slot)
        heapq.heapify(self._free)
        self._used.add(slot)
        self.in_use[slot] = True

    @property
    def packed(self) -> bool:
        """The slots in use are 0..slots_used-1: no free slot below a used one."""
        return not self._free or self._free[0] >= len(self._used)

    @property
    def free_slots(self) -> list[int]:
        return sorted(self._free)

    def free(self, slots: list[int] | int) -> None:
        for slot in [slots] if isinstance(slots, int) else slots:
            if slot not in self._used:
                raise RuntimeError(f"slot {slot} is not in use")
            self._used.remove(slot)
            self.in_use[slot] = False
            heapq.heappush(self._free, slot)

    # --- tensors ----------------------------------------------------------------------------
    def batch(self, slots: list[int], ids: torch.Tensor | None = None) -> SlotBatch:
        """`ids`: the slots as a tensor on the device already (copied there with other inputs)."""
        if ids is None:
            ids = to_device(slots, self.device)
        consecutive = all(b == a + 1 for a, b in zip(slots, slots[1:]))
        span = slice(slots[0], slots[-1] + 1) if slots and consecutive else None
        return SlotBatch(ids=ids, span=span)

    def write(self, layer: int, rows: SlotBatch, positions: torch.Tensor, kv: torch.Tensor) -> None:
        """Store kv [B, T, 2, H, d_h] (keys, then values) at each row's slot and positions [B, T]."""
        slot_index = rows.ids[:, None].expand_as(positions)  # [B, T]
        self.kv[:, layer][:, slot_index, :, positions] = kv

    def write_tokens(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor) -> None:
        """Store kv [N, 2, H, d_h] (keys, then values) of N tokens at their slots [N] and positions [N]."""
        self.kv[:, layer][:, slots, :, positions] = kv

    def read(self, layer: int, rows: SlotBatch, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `length` positions of each row: [B, H, length, d_h]."""
        if rows.span is not None:
            return (
                self.keys[layer, rows.span, :, :length],
                self.values[layer, rows.span, :, :length],
            )
        return (
            self.keys[layer, rows.ids, :, :length],
            self.values[layer, rows.ids, :, :length],
        )

    def scrub(self, slots: list[int]) -> None:
        """Zero what the slots hold: a failed sequence's keys and values may not be finite, and
        a later sequence's masked positions still multiply them (0 * NaN is NaN)."""
        self.kv[:, :, slots] = 0

    def copy_slots(self, src: list[int], dst: list[int], length: int) -> None:
        """Make slot dst[i] hold what src[i] holds (beam reordering), on the device."""
        if not src:
            return
        src_ids, dst_ids = to_device([src, dst], self.device)
        # Indexing on the right copies first, so a permutation among the same slots is safe.
        self.kv[:, :, dst_ids, :, :length] = self.kv[:, :, src_ids, :, :length]

    def swap_slots(self, a: int, b: int, length: int) -> None:
        """Exchange the first `length` positions of two slots."""
        self.copy_slots([a, b], [b, a], length)
