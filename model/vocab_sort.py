"""Rows of vocabulary-wide scores sorted ascending, ties in a fixed order: the sort top-p and
typical-p sampling make of every row they warp.

torch's stable sort gives the order exactly but slowly on a CPU: 86 ms for 16 rows of GPT-2's
50,257 float32 logits (one thread, the 2-core AMD EPYC), more than half a 16-row decode step of
GPT-2 124M. On a CPU the same order comes from numpy's sort of int64 keys (x86-simd-sort's
vectorised sort there): each key is the value's order as an integer in its high bits and its
index in the low bits, so the keys are distinct, and the order of distinct keys is unique
whichever algorithm sorts them. 10 ms for the same 16 rows, with the keys' building.
Elsewhere (CUDA, other dtypes) torch's stable sort serves.
"""

from __future__ import annotations

import numpy as np
import torch

INDEX_BITS = 31  # below the value's 32 order bits: an int64 key stays positive


def sort_ascending(values: torch.Tensor, ties_high_index_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """values [B, V] sorted ascending along V, and where each came from: (sorted [B, V], index [B, V]).

    Equal values (-0.0 and 0.0 among them, as torch compares them) come lowest index first, or
    highest first with `ties_high_index_first` (the reverse of a stable descending sort). The
    same tensors as torch's stable sort on every device, to the bit."""
    if values.device.type != "cpu" or values.dtype != torch.float32 or values.dim() != 2:
        if ties_high_index_first:
            descending, index = values.sort(dim=-1, descending=True, stable=True)
            return descending.flip(-1), index.flip(-1)
        return values.sort(dim=-1, stable=True)
    vocab = values.shape[-1]
    bits = (values + 0.0).view(torch.int32).to(torch.int64)  # + 0.0 makes -0.0 into 0.0: equal, as torch has them
    # The IEEE order as an integer in [0, 2^32): negatives' bits count down as they grow, positives' up.
    order = torch.where(bits < 0, -1 - bits, bits + (1 << 31))  # [B, V]
    position = torch.arange(vocab, dtype=torch.int64)
    keys = (order << INDEX_BITS) | (vocab - 1 - position if ties_high_index_first else position)  # [B, V]
    low = torch.from_numpy(np.sort(keys.numpy(), axis=-1)) & ((1 << INDEX_BITS) - 1)  # [B, V]
    index = vocab - 1 - low if ties_high_index_first else low
    return values.gather(-1, index), index
