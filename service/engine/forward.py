"""The engine's forward from an offset: rows of new tokens, each continuing its own KV-cache slot
at its own position over the keys the slot already holds (a reused prefix, earlier prompt
chunks, the sequence so far). Prefill chunks and speculative verification are both this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.gpt2 import GPT2
from model.kv_cache import KVCache


@dataclass
class OffsetForward:
    # every_position=False: [B, V] at each row's last token; True: [N, V] at every real token,
    # row after row (N = the sum of the rows' lengths).
    logits: torch.Tensor
    hidden: torch.Tensor | None  # [B, T, C] the last block's output, when asked for


def forward_from(
    model: GPT2,
    cache: KVCache,
    slots: list[int],
    starts: list[int],
    pieces: list[list[int]],
    pad_token: int,
    every_position: bool = False,
    hidden_states: bool = False,
) -> OffsetForward:
    """Row b feeds pieces[b] at positions starts[b]... into slot slots[b]."""
    device = cache.device
    lengths = [len(piece) for piece in pieces]
    width = max(lengths)
    # Padding sits after each row, at positions its real tokens never attend to, clamped to the
    # slot's last position, which no sequence ever caches (its last token is never fed).
    padded = [piece + [pad_token] * (width - len(piece)) for piece in pieces]
    input_ids = torch.tensor(padded, device=device)  # [B, T]
    last_position = cache.max_len - 1
    positions = torch.tensor(starts, device=device)[:, None] + torch.arange(width, device=device)
    positions = positions.clamp_(max=last_position)  # [B, T]
    common = dict(kv_length=min(max(starts) + width, last_position + 1), output_hidden_states=hidden_states)
    rows = cache.batch(slots)
    hidden = None
    if not every_position:
        last = torch.tensor([n - 1 for n in lengths], device=device)  # [B]
        out = model(input_ids, positions, cache, rows, logits_index=last, **common)
        logits = out.logits  # [B, V]
    else:
        # The LM head only over real tokens: padding would cost it V columns per position.
        real = torch.tensor([b * width + j for b, n in enumerate(lengths) for j in range(n)], device=device)  # [N]
        out = model(input_ids, positions, cache, rows, apply_head=False, **common)
        logits = model.lm_head(out.head_input.flatten(0, 1)[real])  # [N, V]
    if hidden_states:
        hidden = out.hidden_states[-1]
    return OffsetForward(logits, hidden)
