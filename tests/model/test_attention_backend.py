"""The attention kernel is chosen by the model, not left to torch's default order: cuDNN (which
re-plans for every new key length on Hopper) is never allowed, and the choice is scoped to our
forward, leaving the process's global settings as they were."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import model.attention as attention
from model.kv_cache import KVCache
from tests.model.hf_reference import random_ids
from weights.checkpoint import load_model


def backends_enabled() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {
        "cudnn": cuda.cudnn_sdp_enabled(),
        "flash": cuda.flash_sdp_enabled(),
        "efficient": cuda.mem_efficient_sdp_enabled(),
        "math": cuda.math_sdp_enabled(),
    }


def test_every_attention_call_runs_with_cudnn_disabled(tiny_model_dir, monkeypatch):
    model = load_model(tiny_model_dir)
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        seen.append(backends_enabled())
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording_sdpa)
    before = backends_enabled()
    ids = random_ids(model.config, batch=2, length=6, seed=0)
    cache = KVCache(model.config, 2, 16)
    rows = cache.batch(cache.allocate(2))
    with torch.no_grad():
        model(ids)  # no cache: analysis-free prefill
        model(ids, None, cache, rows, kv_length=6)  # prefill into the cache
        model(ids[:, :1], torch.full((2, 1), 6), cache, rows, kv_length=7)  # one decode step
    # Per layer: one call each for the first two; the decode step runs one per row on CPU.
    assert len(seen) == (2 + len(ids)) * model.config.n_layer
    assert all(flags == {"cudnn": False, "flash": True, "efficient": True, "math": True} for flags in seen), seen
    assert backends_enabled() == before  # scoped to the forward
