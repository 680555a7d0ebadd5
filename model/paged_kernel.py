"""A decode step's attention read straight from the KV cache's blocks: one Triton program per
(row, head) walks the row's block table, so no gathered copy of the keys is made (model/paged_attention.py
chooses and launches it; it imports this module only where Triton is installed).

Each program holds its query in registers and reads its row's keys and values TILE positions at
a time, each position's block found in the table, with the online softmax of flash attention
(running maximum and sum, in float32 whatever the cache's dtype). A row reads exactly its own
`lengths[row]` positions: no length bucket, no mask, nothing read past its end.
"""

from __future__ import annotations

import triton
import triton.language as tl


def decode_attention(
    q_ptr, kv_ptr, tables_ptr, lengths_ptr, out_ptr,
    stride_q_row, stride_q_head, stride_half, stride_head, stride_token, stride_table, stride_out_row, stride_out_head,
    scale, head_dim,
    BLOCK_SIZE: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr,
):
    """q [B, H, d] over the layer's kv [2, H, tokens, d] (keys, then values) through tables [B, ·]
    (block ids) and lengths [B] -> out [B, H, d]. Grid (B, H)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    length = tl.load(lengths_ptr + row)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + row * stride_q_row + head * stride_q_head + dims, mask=dim_ok, other=0.0).to(tl.float32)
    keys = kv_ptr + head * stride_head
    values = keys + stride_half
    top = tl.full((), float("-inf"), tl.float32)  # the running maximum score
    total = tl.zeros((), tl.float32)  # the running sum of exp(score - top)
    acc = tl.zeros((D_PAD,), tl.float32)
    offsets = tl.arange(0, TILE)
    for start in range(0, length, TILE):
        positions = start + offsets
        valid = positions < length
        blocks = tl.load(tables_ptr + row * stride_table + positions // BLOCK_SIZE, mask=valid, other=0)
        where = (blocks * BLOCK_SIZE + positions % BLOCK_SIZE)[:, None] * stride_token + dims[None, :]
        both = valid[:, None] & dim_ok[None, :]
        k = tl.load(keys + where, mask=both, other=0.0).to(tl.float32)  # [TILE, D_PAD]
        scores = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))  # [TILE]
        new_top = tl.maximum(top, tl.max(scores, axis=0))
        weights = tl.exp(scores - new_top)
        fade = tl.exp(top - new_top)
        v = tl.load(values + where, mask=both, other=0.0).to(tl.float32)  # [TILE, D_PAD]
        acc = acc * fade + tl.sum(weights[:, None] * v, axis=0)
        total = total * fade + tl.sum(weights, axis=0)
        top = new_top
    out = acc / total
    tl.store(out_ptr + row * stride_out_row + head * stride_out_head + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


# Under TRITON_INTERPRET=1 (set before Triton is first imported) this is Triton's interpreter, which
# runs on CPU tensors: what the CPU tests use.
compiled = triton.jit(decode_attention)
