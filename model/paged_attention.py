"""Which kernel a decode step's attention reads the KV cache's blocks with, on CUDA.

- "gather" (the default): each layer copies every row's blocks, up to the step's length bucket,
  into one [B, H, L, d_h] buffer, then scaled_dot_product_attention reads it with a mask
  (`KVCache.read`). Simple, any torch; the copy grows with B × L.
- "paged": model/paged_kernel.py's Triton kernel reads each row's own positions through its
  block table; nothing is copied and no position past a row's end is read. Needs Triton (part
  of CUDA builds of torch).

Both run inside the engine's CUDA graphs (the table and the lengths are device tensors the graph
reads). bench/cuda_anchor.py times a decode step with each (`--decode-attention`), which is how
the default is to be chosen. The CPU keeps its own row-by-row path (docs/batch-invariance.md).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

DECODE_ATTENTION = ("gather", "paged")
TILE = 64  # positions a program reads per iteration: four 16-position blocks


def paged_available(device: torch.device) -> bool:
    """Triton is installed, and the device is CUDA, or the CPU under Triton's interpreter (tests)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return importlib.util.find_spec("triton") is not None and (device.type == "cuda" or interpreted)


def check_decode_attention(name: str, device: torch.device) -> None:
    """ValueError when `name` cannot run on `device`."""
    if name not in DECODE_ATTENTION:
        raise ValueError(f"decode attention must be one of {', '.join(DECODE_ATTENTION)}, got {name!r}")
    if name == "paged" and not paged_available(device):
        raise ValueError("decode attention 'paged' needs CUDA and Triton")


@functools.cache
def _kernel():
    from model import paged_kernel  # noqa: PLC0415 (Triton, imported where it is used)

    return paged_kernel.compiled


def paged_decode(
    q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, scale: float, block_size: int,
) -> torch.Tensor:
    """q [B, H, d_h] (one query per row) over one layer's kv [2, H, tokens, d_h] (keys, then
    values), row b reading positions 0..lengths[b]-1 through tables[b] (block ids) -> [B, H, d_h].
    CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before Triton is imported: tests)."""
    B, H, d = q.shape
    if q.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError("paged decode reads rows of contiguous head dimensions")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _kernel()[(B, H)](
        q, kv, tables, lengths, out,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), tables.stride(0), out.stride(0), out.stride(1),
        scale, d,
        BLOCK_SIZE=block_size, D_PAD=max(16, 1 << (d - 1).bit_length()), TILE=TILE,
    )
    return out
