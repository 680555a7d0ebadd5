"""The engine's forward from an offset: rows of new tokens, each continuing its own KV-cache slot
at its own position over the keys the slot already holds (a reused prefix, earlier prompt
chunks, the sequence so far). Prefill chunks and speculative verification are both this.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from model.gpt2 import GPT2, Packing
from model.kv_cache import KVCache
from model.lora import LoraRows
from model.transfer import to_device


@dataclass
class OffsetForward:
    # every_position=False: [B, V] at each row's last token; True: [N, V] at every token, row
    # after row (N = the sum of the rows' lengths).
    logits: torch.Tensor
    hidden: list[torch.Tensor] | None  # per row [n_b, C], the last block's output, when asked for


def forward_from(
    model: GPT2,
    cache: KVCache,
    slots: list[int],
    starts: list[int],
    pieces: list[list[int]],
    every_position: bool = False,
    hidden_states: bool = False,
    one_query_per_call: bool = False,
    lora: LoraRows | None = None,
    ahead: list[bool] | None = None,
    last_tokens: torch.Tensor | None = None,
) -> OffsetForward:
    """Row b feeds pieces[b] at positions starts[b]... into slot slots[b].

    one_query_per_call: each token's attention as a decode step computes it (model.gpt2's
    `attend_by_row`), for speculative verification to give plain decoding's bits.
    lora: row b's LoRA adapter (model/lora.py); None: the base model for every row.
    ahead: rows whose first token the host has not read yet (the core's overlap): it is taken
    from `last_tokens` [slots] on the device, where the sampler left it.

    The rows are packed (model.gpt2.Packing): projections and MLPs run over the real tokens only,
    so rows of different lengths cost what their tokens cost, not rows × the longest.
    """
    device = cache.device
    lengths = [len(piece) for piece in pieces]
    width = max(lengths)
    flat = [(b * width + j, slots[b], starts[b] + j) for b, n in enumerate(lengths) for j in range(n)]
    # One copy for every index vector: [4, N] (input ids in the last row).
    tokens = [token for piece in pieces for token in piece]
    from_device = [int(ahead[b] and j == 0) for b, n in enumerate(lengths) for j in range(n)] if ahead and any(ahead) else None
    index, token_slots, positions, input_ids, *rest = to_device([*zip(*flat), tokens] + ([from_device] if from_device else []),
                                                                 device)
    if rest:
        input_ids = torch.where(rest[0].bool(), last_tokens[token_slots], input_ids)
    packing = Packing(index, len(pieces), width, token_slots, positions)
    kv_length = max(start + n for start, n in zip(starts, lengths))
    out = model.forward_packed(input_ids, packing, cache, cache.batch(slots), kv_length, hidden_states, one_query_per_call, lora)
    head_input = out.head_input  # [N, C]
    if not every_position:
        last = to_device(list(accumulate(lengths)), device) - 1  # [B]
        head_input = head_input[last]  # [B, C]
    hidden = None
    if hidden_states:
        hidden = list(out.hidden_states[-1][0].split(lengths))  # B × [n_b, C]
    return OffsetForward(model.lm_head(head_input), hidden)
