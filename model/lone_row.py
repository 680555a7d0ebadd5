"""Whether oneDNN's kernel for a lone row sums as its kernel for two or more rows does.

oneDNN serves a product of one row (a batch-1 decode) with a kernel of its own. Where that kernel
sums in another order than the batched one, a row's logits change in their last bits with the
batch it is in, which flips sampled tokens (docs/batch-invariance.md): it was seen for GPT-2's
3,072-input MLP projection (3e-6 in the 124M's logits). Where it sums the same way (the 2-core
AMD EPYC with AVX2 this project measures on: every GPT-2 shape, 1 to 8 threads, torch 2.13),
running the row as two, which always gets the batched kernel, costs ~10% of a batch-1 decode
step's CPU for nothing.

So each product's kernel is probed once per shape, post-op and thread count (what oneDNN picks
its kernel by): a few random rows, alone and as one batch. Any bit apart, and a lone row of that
product runs as two.
"""

from __future__ import annotations

import torch

PROBE_ROWS = 4
# (weight [out, in] shape, dtype, post-op, threads) -> the lone kernel gave the batched bits.
_agrees: dict[tuple, bool] = {}


def lone_row_agrees(packed: torch.Tensor, bias: torch.Tensor | None, weight_shape: torch.Size, dtype: torch.dtype,
                    post_op: str, algorithm: str) -> bool:
    """Whether `torch.ops.mkldnn._linear_pointwise` gives a lone row of this product the bits it
    gives the same row among others (probed on its first lone row, then remembered)."""
    key = (tuple(weight_shape), dtype, post_op, torch.get_num_threads())
    agrees = _agrees.get(key)
    if agrees is None:
        agrees = _agrees[key] = _probe(packed, bias, weight_shape[1], dtype, post_op, algorithm)
    return agrees


def _probe(packed: torch.Tensor, bias: torch.Tensor | None, inputs: int, dtype: torch.dtype, post_op: str,
           algorithm: str) -> bool:
    # Its own generator: the probe must not move the global random state a caller may rely on.
    rows = torch.randn(PROBE_ROWS, inputs, generator=torch.Generator().manual_seed(0)).to(dtype)  # [R, in]
    batched = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, post_op, [], algorithm)  # [R, out]
    return all(torch.equal(torch.ops.mkldnn._linear_pointwise(rows[r : r + 1], packed, bias, post_op, [], algorithm)[0],
                           batched[r])
               for r in range(PROBE_ROWS))
