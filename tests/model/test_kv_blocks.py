"""The KV cache as a block pool (model/kv_cache.py): rows take blocks as they grow, and attention
reads exactly the numbers a cache of fixed full-length slots gives.

A cache whose block is a whole row (block_size = max_len) lays its keys out as the fixed-slot
cache did, one [n_head, max_len, head_dim] run per slot: it is the reference. Small blocks handed
out interleaved make every read a gather; handed out in runs, a strided view.
"""

from __future__ import annotations

import pytest
import torch

from model.block_tables import SCRATCH, blocks_for
from model.kv_cache import KVCache
from tests.model.hf_reference import random_ids
from weights.checkpoint import load_model

MAX_LEN = 48
PROMPTS = [5, 19, 11]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def fixed_slots(config) -> KVCache:
    cache = KVCache(config, max_slots=4, max_len=MAX_LEN, block_size=MAX_LEN)
    cache.allocate(4)
    return cache


def grow_in_turn(cache: KVCache) -> None:
    """Rows 2, 0, 3, 1 take a block at a time in turn, up to MAX_LEN positions each."""
    for tokens in range(4, MAX_LEN + 1, 4):
        for row in (2, 0, 3, 1):
            assert cache.ensure(row, tokens)


def interleaved_blocks(config) -> KVCache:
    """Rows 2, 0, 3, 1 grow a block at a time in turn: no row's blocks are consecutive."""
    cache = KVCache(config, max_slots=5, max_len=MAX_LEN, num_blocks=48, block_size=4)  # no homes: 5 rows
    cache.allocate(4, tokens=0)
    grow_in_turn(cache)
    return cache


def runs_of_blocks(config) -> KVCache:
    cache = KVCache(config, max_slots=4, max_len=MAX_LEN, num_blocks=48, block_size=4)
    for _ in range(4):
        cache.allocate(1, tokens=MAX_LEN)
    return cache


def rows_growing_at_home(config) -> KVCache:
    """The same growth in a pool holding every row at full length: each row takes its home
    blocks (a fixed slot's), so the rows read as one view."""
    cache = KVCache(config, max_slots=4, max_len=MAX_LEN, block_size=4)
    cache.allocate(4, tokens=0)
    grow_in_turn(cache)
    return cache


def rows_moved_at_home(config) -> KVCache:
    """Rows at home, then rows 1 and 3 swapped by a packing move and row 0's first two blocks out
    of order: no view of the batch; rows 1..3 each one run (read as views), row 0 gathered alone."""
    cache = rows_growing_at_home(config)
    cache.move_row(1, 3)
    cache.tables[0, :2] = cache.tables[0, [1, 0]].copy()
    cache._tables_changed()
    return cache


def tables_copied_as_on_cuda(config) -> KVCache:
    """Interleaved blocks, the tables read from a device copy refreshed when they change (as on
    CUDA, where the host's tables are not the device's) and never as a view."""
    cache = KVCache(config, max_slots=5, max_len=MAX_LEN, num_blocks=48, block_size=4)  # no homes: 5 rows
    cache._shared_tables = False
    cache.device_tables = torch.from_numpy(cache.tables.copy())
    cache.allocate(4, tokens=0)
    grow_in_turn(cache)
    assert cache._tables_stale
    return cache


@torch.no_grad()
def decode_logits(model, cache: KVCache, slots: list[int]) -> list[torch.Tensor]:
    """Prefill each row alone (packed), then decode the rows together to MAX_LEN - 8 positions."""
    sequences = random_ids(model.config, batch=len(slots), length=MAX_LEN, seed=3)
    out = []
    for b, (slot, n) in enumerate(zip(slots, PROMPTS)):
        out.append(model(sequences[b:b + 1, :n], positions=torch.arange(n)[None], cache=cache,
                         rows=cache.batch([slot])).logits[0])
    rows = cache.batch(slots)
    positions = PROMPTS[: len(slots)]  # one per row (all three broadcast a lone row to three)
    while max(positions) < MAX_LEN - 8:
        ids = torch.stack([seq[p] for seq, p in zip(sequences, positions)])[:, None]
        out.append(model(ids, positions=torch.tensor(positions)[:, None], cache=cache, rows=rows).logits[:, -1])
        positions = [p + 1 for p in positions]
    return out


@pytest.mark.parametrize("slots", [[2, 0, 3], [0], [1, 2, 3]], ids=["scattered rows", "one row", "a span"])
def test_blocks_give_the_fixed_slot_cache_logits_bit_for_bit(model, slots):
    reference = decode_logits(model, fixed_slots(model.config), slots)
    for layout in (interleaved_blocks, runs_of_blocks, rows_growing_at_home, rows_moved_at_home, tables_copied_as_on_cuda):
        cache = layout(model.config)
        for ours, theirs in zip(decode_logits(model, cache, slots), reference, strict=True):
            assert torch.equal(ours, theirs), layout.__name__


def test_reads_are_views_only_where_the_blocks_lie_like_slots(model):
    interleaved, runs = interleaved_blocks(model.config), runs_of_blocks(model.config)
    assert interleaved._view(slice(0, 1), blocks_for(MAX_LEN, 4)) is None  # row 0 is not one run
    assert runs._view(slice(1, 4), blocks_for(MAX_LEN, 4)) == (1 + 12, 12)  # rows 1..3: every 12th block
    assert rows_growing_at_home(model.config)._view(slice(0, 4), blocks_for(MAX_LEN, 4)) == (1, 12)
    keys, _ = runs.read(0, runs.batch([1, 2, 3]), 20)
    assert keys._base is not None and keys.data_ptr() == runs.keys[0, :, 13 * 4].data_ptr()


@torch.no_grad()
def test_rows_read_alone_are_views_unless_their_own_blocks_are_scattered(model):
    """CPU decode reads each row's own keys (`row_reads`): a row whose blocks are one run is a view
    wherever they lie, and only a row whose blocks are not is gathered, with the batch's numbers."""
    cache = rows_moved_at_home(model.config)
    cache.kv.normal_()
    rows = cache.batch([0, 1, 2, 3])
    assert cache._view(rows.span, blocks_for(40, 4)) is None  # the batch read gathers every row
    reads = cache.row_reads(rows, [40, 21, 9, 33])
    assert reads.starts[0] is None and reads.starts[1:] == [(1 + 36) * 4, (1 + 24) * 4, (1 + 12) * 4]
    assert reads.gathered.tolist() == cache.tables[0, :10].tolist()  # row 0's ten blocks only
    keys, values = cache.read_rows(2, reads)
    batch_keys, batch_values = cache.read(2, rows, 40)
    for b, length in enumerate(reads.lengths):
        assert keys[b].shape == (1, model.config.n_head, length, model.config.head_dim)
        assert torch.equal(keys[b], batch_keys[b : b + 1, :, :length])
        assert torch.equal(values[b], batch_values[b : b + 1, :, :length])
    assert keys[3].data_ptr() == cache.keys[2, :, 13 * 4].data_ptr()  # row 3 holds row 1's home blocks


def test_rows_take_blocks_as_they_grow_and_give_them_back(model):
    cache = KVCache(model.config, max_slots=3, max_len=MAX_LEN, num_blocks=5, block_size=4)
    [row] = cache.allocate(1, tokens=0)
    assert cache.blocks_free == 5 and cache.blocks_of(row) == []
    assert cache.ensure(row, 1) and cache.blocks_of(row) == [1]
    assert cache.ensure(row, 4) and cache.blocks_of(row) == [1]  # still inside its first block
    assert cache.ensure(row, 9) and cache.blocks_of(row) == [1, 2, 3]  # the next ones, in a run
    [other] = cache.allocate(1, tokens=8)
    assert cache.blocks_of(other) == [4, 5] and cache.blocks_free == 0
    assert not cache.ensure(row, 13) and cache.blocks_of(row) == [1, 2, 3]  # nothing taken
    assert cache.tables[row, 3] == SCRATCH  # beyond its blocks, a row points at the scratch block
    cache.free(row)
    assert cache.blocks_free == 3 and cache.blocks_of(row) == []
    assert cache.ensure(other, 12) and cache.blocks_of(other) == [4, 5, 1]
    with pytest.raises(RuntimeError, match="free blocks"):
        cache.allocate(1, tokens=MAX_LEN)


def test_moves_carry_blocks_and_registered_ones_stay_cached_for_a_later_row(model):
    cache = KVCache(model.config, max_slots=3, max_len=MAX_LEN, num_blocks=6, block_size=4)
    a, b = cache.allocate(2, tokens=8)
    cache.register(a, 0, "a's first block")  # its positions 0..3 computed
    cache.move_row(a, b)
    assert cache.blocks_of(a) == [3, 4] and cache.blocks_of(b) == [1, 2]
    cache.free(b)
    assert cache.blocks_free == 4 and cache.pool.cached_free_count == 1  # block 1 cached, 2 plainly free
    [c] = cache.allocate(1, tokens=0)
    cache.share(c, [cache.pool.lookup("a's first block")])
    assert cache.blocks_of(c) == [1] and cache.refs[1] == 1 and cache.blocks_free == 3
    assert cache.ensure(c, 8) and cache.blocks_of(c) == [1, 2]  # grows on from the shared block


@torch.no_grad()
def test_copies_and_scrubs_touch_only_the_rows_blocks(model):
    cache = KVCache(model.config, max_slots=3, max_len=MAX_LEN, num_blocks=12, block_size=4)
    a, b, c = cache.allocate(3, tokens=12)
    cache.kv.normal_()
    b_before = cache.read(1, cache.batch([b]), 12)[0].clone()
    cache.copy_slots([a], [b], 6)  # whole blocks: positions 0..7
    keys, values = cache.read(1, cache.batch([a, b, c]), 12)
    assert torch.equal(keys[1, :, :8], keys[0, :, :8]) and torch.equal(values[1, :, :8], values[0, :, :8])
    assert torch.equal(keys[1, :, 8:], b_before[0, :, 8:])  # its third block is its own still
    untouched = cache.read(1, cache.batch([c]), 12)[0].clone()
    cache.scrub(cache.blocks_of(a))
    assert not cache.read(1, cache.batch([a]), 12)[0].any()
    assert torch.equal(cache.read(1, cache.batch([c]), 12)[0], untouched)


@torch.no_grad()
def test_forked_rows_share_blocks_until_one_writes_then_it_copies(model):
    cache = KVCache(model.config, max_slots=3, max_len=MAX_LEN, num_blocks=8, block_size=4)
    a, b = cache.allocate(2, tokens=0)
    assert cache.ensure(a, 10)  # three blocks, the last one partly written
    cache.kv.normal_()
    cache.fork(a, b, 10)
    assert cache.blocks_of(b) == cache.blocks_of(a) and cache.blocks_free == 5
    before = cache.read(1, cache.batch([a]), 12)[0].clone()
    assert cache.writable(b, 10, 11)  # b writes position 10: its third block becomes its own
    assert cache.blocks_of(b)[:2] == cache.blocks_of(a)[:2] and cache.blocks_of(b)[2] != cache.blocks_of(a)[2]
    assert torch.equal(cache.read(1, cache.batch([b]), 12)[0], before)  # a copy of what it shared
    cache.write(1, cache.write_index(torch.tensor([b]), torch.tensor([10])), torch.zeros(1, 2, 4, model.config.head_dim))
    assert torch.equal(cache.read(1, cache.batch([a]), 12)[0], before)  # a's block untouched
    own = cache.blocks_of(a)[2]
    assert cache.release(a) == [own] and cache.blocks_free == 8 - 3  # the two shared ones are b's now
    assert cache.release(b) and cache.blocks_free == 8


def test_a_copy_on_write_goes_into_the_rows_home_block_where_it_is_free(model):
    """With homes, a row copying a shared block takes its own home block for it (not the lowest
    free one): a row whose every block is a copy stays one run, read as a view."""
    cache = KVCache(model.config, max_slots=3, max_len=MAX_LEN, block_size=4)
    assert cache.homes
    a, b = cache.allocate(2, tokens=0)
    assert cache.ensure(a, 10)
    cache.fork(a, b, 10)
    assert cache.writable(b, 10, 11)
    home = 1 + b * cache.blocks_per_row + 2
    assert cache.blocks_of(b)[2] == home
    assert cache.writable(b, 0, 11) and cache.blocks_of(b) == [home - 2, home - 1, home]
    assert cache.row_reads(cache.batch([b]), [11]).gathered is None  # one run: a view


@torch.no_grad()
def test_with_homes_a_cached_prefix_is_copied_home_and_without_them_shared(model):
    """Where every row has its home (and decode reads views: the CPU), a row starting from
    cached blocks takes copies in its home blocks: one run, read as a view, the cache untouched.
    Where the pool is short of homes, it holds the cached blocks themselves (no bytes spent)."""
    for num_blocks, copies in ((None, True), (3 * blocks_for(MAX_LEN, 4) - 1, False)):
        cache = KVCache(model.config, max_slots=3, max_len=MAX_LEN, num_blocks=num_blocks, block_size=4)
        assert cache.homes == copies
        a, b = cache.allocate(2, tokens=8)
        cache.kv.normal_()
        cache.register(a, 0, "a0")
        cache.register(a, 1, "a1")
        theirs = cache.blocks_of(a)
        cache.free(a)
        cached = [cache.pool.lookup("a0"), cache.pool.lookup("a1")]
        assert cached == theirs
        _, c = cache.allocate(2, tokens=0)  # a's row again, and a row whose home lies elsewhere
        cache.share(c, cached)
        mine = cache.blocks_of(c)
        if copies:
            home = 1 + c * cache.blocks_per_row
            assert mine == [home, home + 1] and cache.refs[cached].tolist() == [0, 0]
            assert [cache.pool.lookup("a0"), cache.pool.lookup("a1")] == cached  # still cached, free
            assert cache.row_reads(cache.batch([c]), [8]).gathered is None  # one run: a view
        else:
            assert mine == cached and cache.refs[cached].tolist() == [1, 1]
        by_block = cache.kv.view(*cache.kv.shape[:3], -1, 4, cache.kv.shape[-1])
        assert torch.equal(by_block[:, :, :, mine], by_block[:, :, :, cached])
        assert not held_twice_or_free_wrongly(cache)


@torch.no_grad()
def test_a_cached_block_in_a_growing_rows_home_is_moved_aside_with_its_content(model):
    """Rows growing into their homes find cached prefixes there moved to free blocks: the keys
    follow them (copied before the next forward, all of a step's moves in one copy), even when a
    block moved is moved again before that."""
    cache = KVCache(model.config, max_slots=3, max_len=MAX_LEN, block_size=4)
    by_block = cache.kv.view(*cache.kv.shape[:3], -1, 4, cache.kv.shape[-1])
    [a] = cache.allocate(1, tokens=4)
    cache.kv.normal_()
    content = by_block[:, :, :, cache.blocks_of(a)[0]].clone()
    cache.register(a, 0, "a0")
    cache.free(a)  # a's first block (its home's first) stays cached, free
    [again] = cache.allocate(1, tokens=4)  # the same row grows into its home again
    moved = cache.pool.lookup("a0")
    assert again == a and moved not in cache.blocks_of(a) and cache.pool.evictions == 0
    # It moved to the lowest free block: the row's own next home block, which it now grows into.
    assert cache.ensure(a, 8) and cache.blocks_of(a)[1] == moved
    assert cache.pool.lookup("a0") not in (moved, *cache.blocks_of(a)) and cache.pool.evictions == 0
    cache.sync_tables()  # what a forward runs first
    assert torch.equal(by_block[:, :, :, cache.pool.lookup("a0")], content)
    assert not held_twice_or_free_wrongly(cache)


def held_twice_or_free_wrongly(cache: KVCache) -> bool:
    """Whether some block's count of rows holding it is wrong, or a block is both held and free."""
    counts = torch.zeros(cache.num_blocks + 1, dtype=torch.long)
    for row in range(cache.max_slots):
        for block in cache.blocks_of(row):
            counts[block] += 1
    held = {block for block in range(1, cache.num_blocks + 1) if counts[block]}
    free = cache.pool._free | set(cache.pool._cached_free)  # uncached and cached free blocks
    return counts[1:].tolist() != cache.refs[1:].tolist() or bool(held & free) \
        or len(held) + cache.blocks_free != cache.num_blocks


@torch.no_grad()
def test_rows_sharing_their_sources_blocks_copy_only_the_partial_last_one(model):
    """share_rows (a beam search's step): each row lets its blocks go and holds its source's first
    `length` positions, its full blocks shared and the partial last one (which it writes next)
    copied, all at once; the pool ends as release, fork and writable row by row leave it."""
    def setup() -> KVCache:
        cache = KVCache(model.config, max_slots=5, max_len=MAX_LEN, num_blocks=40, block_size=4)
        rows = cache.allocate(5, tokens=0)
        for row, tokens in zip(rows, (10, 12, 7, 9, 0)):
            assert cache.ensure(row, tokens)
        cache.fork(0, 4, 10)  # row 4 shares row 0's blocks, as a beam's prompt does
        torch.manual_seed(0)
        cache.kv.normal_()
        return cache

    sources, rows, lengths = [0, 0, 1], [2, 3, 4], [10, 10, 12]
    cache, reference = setup(), setup()
    before = {row: cache.read(1, cache.batch([row]), 12) for row in (0, 1)}
    assert cache.share_rows(sources, rows, lengths)
    for source, row, length in zip(sources, rows, lengths):
        reference.release(row)
        reference.fork(source, row, length)
        assert reference.writable(row, length, length + 1)
    assert not held_twice_or_free_wrongly(cache) and cache.blocks_free == reference.blocks_free
    for source, row, length in zip(sources, rows, lengths):
        full = length // 4
        assert cache.blocks_of(row)[:full] == cache.blocks_of(source)[:full]
        assert len(cache.blocks_of(row)) == len(reference.blocks_of(row))
        if length % 4:  # its own copy of the partial block
            assert cache.refs[cache.blocks_of(row)[full]] == 1 and cache.refs[cache.blocks_of(source)[full]] == 1
        keys, values = cache.read(1, cache.batch([row]), length)
        source_keys, source_values = before[source]
        assert torch.equal(keys[0], source_keys[0, :, :length]) and torch.equal(values[0], source_values[0, :, :length])
    cache.write(1, cache.write_index(torch.tensor([2]), torch.tensor([10])), torch.zeros(1, 2, 4, model.config.head_dim))
    assert torch.equal(cache.read(1, cache.batch([0]), 12)[0], before[0][0])  # the source's block untouched
