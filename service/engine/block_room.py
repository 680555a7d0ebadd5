"""Room in the KV cache's block pool: what admission checks, what decode takes as rows grow.

The pool (model/kv_cache.py, model/block_pool.py) is a memory budget in blocks; free blocks
that hold a cached prefix (prefix_cache.py) count as free, the pool evicting the least recently
freed of them when a row needs one and no other is free. A request is admitted only when the
blocks its prompt does not share, on every one of its sequences' rows, are free; a decoding row
takes a block as it crosses into one.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from model.block_tables import blocks_for
from model.kv_cache import KVCache
from service.engine.prefix_cache import PrefixMatch
from service.engine.requests import RequestState
from service.engine.row_features import uses_counts, uses_history
from service.engine.types import GenerationRequest
from service.engine.validation import slots_needed


class OutOfBlocks(RuntimeError):
    """Running sequences need more blocks than the pool has, cached ones included."""


def recomputable(state: RequestState, once_read: bool = False) -> bool:
    """Whether a running request can be preempted and recomputed from its tokens alone: one
    sequence, no beam search, no prompt scores, nothing the sampler counted from its generated
    tokens on the device (penalties' counts, n-gram history), no token in flight (`once_read`:
    it will be, once the token in flight is read)."""
    p = state.params
    return (state.beam is None and len(state.sequences) == 1 and not p.prompt_logprobs
            and p.repetition_penalty == 1.0 and not uses_counts(p) and not uses_history(p)
            and (once_read or state.sequences[0].pending == 0))


class BlockRoom:
    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def check_fits(self, request: GenerationRequest) -> None:
        """Refuse a request that could never run: its sequences at full length need more blocks
        than the whole pool."""
        params = request.params
        tokens = min(len(request.prompt_ids) + params.max_new_tokens, self.cache.max_len)
        needed = slots_needed(params) * blocks_for(tokens, self.cache.block_size)
        if needed > self.cache.num_blocks:
            raise ValueError(
                f"the request needs up to {needed} KV-cache blocks of {self.cache.block_size} positions"
                f" ({slots_needed(params)} sequences of {tokens} tokens); the cache holds"
                f" {self.cache.num_blocks} (raise --kv-cache-bytes)")

    def admits(self, state: RequestState, match: PrefixMatch | None, running: int) -> bool:
        """Whether the pool has room for the prompt on every one of the request's rows, and a
        block to spare for each of the `running` requests (so that admitting one does not make
        the next decode step preempt it at once)."""
        shared = match.blocks if match is not None else []
        # Shared blocks lying free in the cache stop being free once held.
        available = self.cache.blocks_free - sum(int(self.cache.refs[block] == 0) for block in shared)
        return self._prompt_blocks(state, len(shared)) + running <= available

    def place(self, state: RequestState, slots: list[int], match: PrefixMatch | None = None) -> None:
        """Blocks for the prompt on an admitted request's rows (`admits` said they fit): the
        first row's, which the other samples fork once it is prefilled; every beam's, each its own
        (a beam step reorders them by copies). The first row starts with the cached blocks
        `match` found, shared."""
        beams = state.params.num_beams > 1  # (its search starts after this)
        rows = slots if beams else slots[:1]
        if match is not None:
            self.cache.share(slots[0], match.blocks)
        for slot in rows:
            if not self.cache.ensure(slot, state.prompt_length):
                raise OutOfBlocks(f"no blocks for the prompt of {state.request.request_id}")
            if beams:
                self.writable(slot, 0, state.prompt_length)

    def grow(self, slots: np.ndarray, written: np.ndarray) -> None:
        """A block for each decoding row on `slots` whose write this step (position `written` - 1)
        starts one, and a copy of the block it writes where that one is shared. The scheduler finds
        those rows with array operations (most steps, most rows need neither); a row given that
        needs nothing (grown before a preemption retried) costs a check."""
        for slot, end in zip(slots.tolist(), written.tolist()):
            self._ensure(slot, end)
            self.writable(slot, end - 1, end)

    def grow_drafts(self, decode: Iterable[RequestState]) -> None:
        """Blocks for the drafted positions a verification writes; a draft with no room is cut."""
        for state in decode:
            for seq in state.live:
                if not seq.draft:
                    continue
                start = len(seq.token_ids) + seq.pending
                if not self._ensure(seq.slot, start + len(seq.draft), required=False):
                    room = int(self.cache.row_blocks[seq.slot]) * self.cache.block_size - start
                    seq.draft = seq.draft[: max(room, 0)]
                self.writable(seq.slot, start, start + len(seq.draft))

    def writable(self, slot: int, start: int, end: int) -> None:
        """The row's blocks for positions [start, end) its own (copy on write), before it writes them."""
        if not self.cache.writable(slot, start, end):
            raise OutOfBlocks(f"the KV cache has no free block to copy row {slot}'s shared blocks into")

    def _ensure(self, slot: int, tokens: int, required: bool = True) -> bool:
        if self.cache.ensure(slot, tokens):
            return True
        if required:
            raise OutOfBlocks(f"the KV cache has no free block for row {slot} at {tokens} tokens")
        return False

    def _prompt_blocks(self, state: RequestState, shared: int) -> int:
        """The prompt's new blocks (`shared`: how many its first row shares from the cache):
        once, its samples sharing them and each taking one of its own for its first token; on
        every row for a beam search (each beam a copy of its own)."""
        per_row = blocks_for(state.prompt_length, self.cache.block_size)
        if state.params.num_beams > 1:
            return state.slots_needed * per_row
        return per_row - shared + state.slots_needed - 1
