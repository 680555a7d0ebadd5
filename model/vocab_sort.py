"""Rows of vocabulary-wide scores sorted ascending, ties in a fixed order: the sort top-p and
typical-p sampling make of every row they warp.

torch's stable sort gives the order exactly but slowly on a CPU: 86 ms for 16 rows of GPT-2's
50,257 float32 logits (one thread, the 2-core AMD EPYC), more than half a 16-row decode step of
GPT-2 124M. On a CPU the same order comes from numpy's sort of int64 keys (x86-simd-sort's
vectorised sort there): each key is the value's order as an integer in its high bits and its
index in the low bits, so the keys are distinct, and the order of distinct keys is unique
whichever algorithm sorts them. 10.7 ms for the same 16 rows (two threads), the keys' building
included.
Elsewhere (CUDA, other dtypes) torch's stable sort serves.
"""

from __future__ import annotations

import numpy as np
import torch

INDEX_BITS = 31  # below the value's 32 order bits (signed: the keys span [-2^62, 2^62))


def sort_ascending(values: torch.Tensor, ties_high_index_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """values [B, V] sorted ascending along V, and where each came from: (sorted [B, V], index [B, V]).

    Equal values (-0.0 and 0.0 among them, as torch compares them) come lowest index first, or
    highest first with `ties_high_index_first` (the reverse of a stable descending sort). The
    same tensors as torch's stable sort on every device, to the bit. (A row holding a NaN may be
    ordered otherwise on the CPU: its request fails on its non-finite logits anyway.)"""
    if values.device.type != "cpu" or values.dtype != torch.float32 or values.dim() != 2:
        if ties_high_index_first:
            descending, index = values.sort(dim=-1, descending=True, stable=True)
            return descending.flip(-1), index.flip(-1)
        return values.sort(dim=-1, stable=True)
    vocab = values.shape[-1]
    # In numpy, in place: a fifth of the time torch's int64 operations took on these arrays.
    bits = (values.numpy() + np.float32(0.0)).view(np.int32)  # + 0.0 makes -0.0 into 0.0: equal, as torch has them
    # The IEEE order as a signed integer: a negative float's magnitude bits are flipped, so they
    # count up as it grows.
    bits ^= (bits >> 31) & np.int32(0x7FFFFFFF)
    keys = bits.astype(np.int64)  # [B, V]
    keys <<= INDEX_BITS
    keys |= np.arange(vocab - 1, -1, -1) if ties_high_index_first else np.arange(vocab)
    keys.sort(axis=-1)
    keys &= (1 << INDEX_BITS) - 1
    if ties_high_index_first:
        np.subtract(vocab - 1, keys, out=keys)
    index = torch.from_numpy(keys)  # [B, V]
    return values.gather(-1, index), index
