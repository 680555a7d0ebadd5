"""The smallest greedy decoding loops over the model: with the KV cache, and without it.

They are the model-level reference the benchmark times and the fast-path tests drive; the
service decodes through service/engine.py, which adds scheduling, sampling and streaming.
"""

from __future__ import annotations

import torch

from model.gpt2 import GPT2
from model.kv_cache import KVCache


@torch.inference_mode()
def greedy_generate(
    model: GPT2,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    cache: KVCache | None = None,
) -> torch.Tensor:
    """Greedy tokens [B, max_new_tokens] after equal-length prompts [B, T], one cache slot per row."""
    batch, prompt_length = prompt_ids.shape
    total = prompt_length + max_new_tokens
    if cache is None:
        cache = KVCache(model.config, batch, total, model.device, model.dtype)
    slots = cache.allocate(batch)
    try:
        rows = cache.batch(slots)
        last = torch.full((batch,), prompt_length - 1, device=model.device)  # [B]
        logits = model(prompt_ids, cache=cache, rows=rows, logits_index=last).logits  # [B, V]
        tokens = [logits.argmax(-1)]  # each [B]
        for position in range(prompt_length, total - 1):
            positions = torch.full((batch, 1), position, device=model.device)  # [B, 1]
            out = model(tokens[-1][:, None], positions, cache, rows, kv_length=position + 1)
            tokens.append(out.logits[:, -1].argmax(-1))  # [B]
        return torch.stack(tokens, dim=1)  # [B, max_new_tokens]
    finally:
        cache.free(slots)


@torch.inference_mode()
def greedy_generate_uncached(model: GPT2, prompt_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The same tokens, recomputing the whole prefix every step (quadratic; for comparison)."""
    ids = prompt_ids
    for _ in range(max_new_tokens):
        last = torch.full((ids.shape[0],), ids.shape[1] - 1, device=ids.device)  # [B]
        next_token = model(ids, logits_index=last).logits.argmax(-1)  # [B]
        ids = torch.cat([ids, next_token[:, None]], dim=1)  # [B, T+1]
    return ids[:, prompt_ids.shape[1] :]  # [B, max_new_tokens]
