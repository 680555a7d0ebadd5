"""Decode steps with static shapes, replayed as CUDA graphs: one launch instead of ~300.

A decode forward becomes static when three things are fixed:
- the batch: slots 0..Bp-1, Bp the next size of a ladder (1, 2, 4, 8, ... max_slots) above the
  highest decoding slot (the scheduler keeps running sequences packed in the lowest slots). The
  rows of other slots (free ones, and prompts still being prefilled) are padding: they feed a
  token at the slot's last position, max_len-1, which no sequence ever caches (the last token of
  a full-length sequence is never fed); a free slot's table points there at the scratch block;
- the keys read: a length bucket (64, 128, 256, ... max_len) at least as long as the longest row,
  each row masked beyond its own position;
- the buffers: input ids, positions and logits live in tensors allocated once, which a step
  fills and reads; the KV cache's block tables live on the device in one tensor (a static
  input), which `run` brings up to date before a replay.
Attention reads each row's blocks through the device's block tables, so a graph holds no slot
ids and no block ids. Sampling stays outside the graph (vectorised, a handful of kernels).

On CUDA (`capture()`), each (batch size, length bucket) pair is captured once at start-up, then
checked against the eager forward; a mismatch or any capture error turns graphs off with a
warning, never wrong tokens. Elsewhere `run` executes the same static forward eagerly: the CPU
tests prove the padding, bucketing and masking give the dynamic path's tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from model.gpt2 import GPT2
from model.kv_cache import KVCache
from model.transfer import to_device

log = logging.getLogger(__name__)

SMALLEST_LENGTH_BUCKET = 64


def ladder(limit: int, start: int = 1) -> list[int]:
    """start, 2·start, 4·start, ... below limit, then limit itself."""
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= 2
    return sizes + [limit]


def next_size(sizes: list[int], needed: int) -> int:
    return next(size for size in sizes if size >= needed)


@dataclass
class StaticBuffers:
    input_ids: torch.Tensor  # [max_slots, 1]
    positions: torch.Tensor  # [max_slots, 1]


class StaticDecode:
    def __init__(self, model: GPT2, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.batch_sizes = ladder(cache.max_slots)
        self.length_buckets = ladder(cache.max_len, min(SMALLEST_LENGTH_BUCKET, cache.max_len))
        device = cache.device
        self.buffers = StaticBuffers(
            input_ids=torch.zeros(cache.max_slots, 1, dtype=torch.long, device=device),
            positions=torch.zeros(cache.max_slots, 1, dtype=torch.long, device=device),
        )
        # Made once: a host→device copy cannot happen while a graph is being captured.
        self.slot_batches = {size: cache.batch(list(range(size))) for size in self.batch_sizes}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def run(
        self,
        slots: list[int] | np.ndarray,
        token_ids: list[int] | np.ndarray,
        positions: list[int] | np.ndarray,
        ahead: list[bool] | np.ndarray | None = None,
        last_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, V] for the rows on `slots` (ascending), row b feeding token_ids[b] at
        positions[b]; or, where ahead[b], its slot's entry of `last_tokens` [max_slots] (a
        token the host has not read yet: the core's overlap)."""
        slots = np.asarray(slots, dtype=np.int64)
        count = len(slots)
        size = next_size(self.batch_sizes, int(slots[-1]) + 1)
        bucket = next_size(self.length_buckets, int(np.max(positions)) + 1)
        packed = int(slots[-1]) == count - 1  # ascending and distinct: slots 0..B-1
        # One copy, made before the forward is queued: [3, size] (+ the rows when not packed):
        # token ids, positions (padding rows at the last, which no sequence caches), from_device.
        host = np.zeros((3 if packed else 4, size), dtype=np.int64)
        host[1] = self.cache.max_len - 1
        host[0, slots], host[1, slots] = token_ids, positions
        from_device = ahead is not None and bool(np.any(ahead))
        if from_device:
            host[2, slots] = ahead
        if not packed:
            host[3, :count] = slots
        host = to_device(torch.from_numpy(host), self.cache.device)
        if from_device:
            self.buffers.input_ids[:size, 0].copy_(torch.where(host[2].bool(), last_tokens[:size], host[0]))
        else:
            self.buffers.input_ids[:size, 0].copy_(host[0])
        self.buffers.positions[:size, 0].copy_(host[1])
        rows = None if packed else host[3, :count]
        graph = self.graphs.get((size, bucket))
        if graph is not None:
            # The graph reads the device's block tables; an eager forward syncs them as it runs.
            self.cache.sync_tables()
            graph[0].replay()
            logits = graph[1]  # [size, V]
        else:
            logits = self._forward(size, bucket)
        return logits[:count] if rows is None else logits[rows]  # [B, V]

    def _forward(self, size: int, bucket: int) -> torch.Tensor:
        out = self.model(
            self.buffers.input_ids[:size],
            self.buffers.positions[:size],
            self.cache,
            self.slot_batches[size],
            kv_length=bucket,
            exact_kv_length=False,
        )
        return out.logits[:, -1]  # [size, V]

    # --- CUDA ---------------------------------------------------------------------------------------
    def capture(self) -> bool:
        """Capture every (batch size, length bucket) graph; False (and none kept) on any failure."""
        try:
            pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.inference_mode(), torch.cuda.stream(stream):
                # Largest first, so the smaller graphs reuse the pool's blocks.
                for size in reversed(self.batch_sizes):
                    for bucket in reversed(self.length_buckets):
                        self._forward(size, bucket)  # warm-up: lazy initialisation stays out of the graph
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool, stream=stream):
                            logits = self._forward(size, bucket)
                        self.graphs[(size, bucket)] = (graph, logits)
            torch.cuda.current_stream().wait_stream(stream)
            self._check()
        except Exception as exc:  # a graph we cannot trust is a graph we do not use
            log.warning("CUDA graphs are off: %s: %s", type(exc).__name__, exc)
            self.graphs.clear()
            return False
        log.info("captured %d CUDA graphs for decode (batch sizes %s, key lengths %s)",
                 len(self.graphs), self.batch_sizes, self.length_buckets)
        return True

    @torch.inference_mode()
    def _check(self) -> None:
        """Replay against the eager forward on the same inputs. The rows get blocks of their own
        for the check (rows without any all write the scratch block, in an order the device does
        not fix), holding zeros or leftovers from capture; both paths read the same ones."""
        for size, bucket in [(self.batch_sizes[0], self.length_buckets[0]), (self.batch_sizes[-1], self.length_buckets[-1])]:
            tokens = min(bucket, self.cache.blocks_free // size * self.cache.block_size)
            if tokens == 0:  # too few blocks for every row: the smaller pair checks the capture
                continue
            generator = torch.Generator(device="cpu").manual_seed(size)
            ids = torch.randint(0, self.model.config.vocab_size, (size,), generator=generator).tolist()
            positions = torch.randint(0, tokens, (size,), generator=generator).tolist()
            positions[-1] = tokens - 1  # the longest row picks the graph replayed: this one
            checked = (size, next_size(self.length_buckets, tokens))  # (bucket, unless blocks are short)
            slots = self.cache.allocate(size, tokens)
            try:
                graph_logits = self.run(slots, ids, positions).float().clone()
                graph = self.graphs.pop(checked)
                eager_logits = self.run(slots, ids, positions).float()
                self.graphs[checked] = graph
            finally:
                self.cache.free(slots)
            # Same kernels, same inputs: only the order of floating-point sums may differ.
            if not torch.allclose(graph_logits, eager_logits, rtol=1e-2, atol=1e-2):
                worst = (graph_logits - eager_logits).abs().max().item()
                raise RuntimeError(f"graph replay differs from eager decode by {worst:.3g} (batch {size}, keys {checked[1]})")
