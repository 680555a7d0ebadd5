"""The static decode path (service/engine/graphs.py) that CUDA graphs replay, run eagerly here:
padding to the batch ladder, key-length buckets and per-row masks give the dynamic path's
logits and tokens, whatever stale keys the cache holds beyond each row."""

from __future__ import annotations

import pytest
import torch

from model.block_tables import SCRATCH
from model.kv_cache import KVCache
from service.engine.graphs import StaticDecode, ladder, next_size
from tests.conftest import TINY
from tests.engine.conftest import hf_generate, make_request, random_prompt, run_until_idle

LOGIT_TOLERANCE = 1e-5  # the same fp32 arithmetic; only masked-out keys differ


def test_ladders_cover_every_size_up_to_the_limit():
    assert ladder(12) == [1, 2, 4, 8, 12]
    assert ladder(1024, 64) == [64, 128, 256, 512, 1024]
    assert ladder(64, 64) == [64]
    assert [next_size([1, 2, 4, 8, 12], n) for n in (1, 3, 5, 9, 12)] == [1, 4, 8, 12, 12]


@pytest.mark.parametrize("positions", [[7], [5, 70, 0], [127, 3, 64, 1]], ids=["one-row", "padded", "full"])
@torch.no_grad()
def test_static_decode_equals_dynamic_decode_over_stale_cache_entries(tiny_model, positions):
    stale = torch.Generator().manual_seed(0)
    caches = [KVCache(TINY, 4, TINY.n_positions, device=tiny_model.device) for _ in range(2)]
    keys = torch.randn(caches[0].keys.shape, generator=stale).to(tiny_model.device)
    values = torch.randn(caches[0].values.shape, generator=stale).to(tiny_model.device)
    for cache in caches:  # the same leftovers everywhere, as slots reused by earlier requests hold
        cache.allocate(cache.max_slots)  # each row with its blocks, as the engine's running rows
        cache.keys.copy_(keys)
        cache.values.copy_(values)
    ids = random_prompt(len(positions), seed=1)
    static = StaticDecode(tiny_model, caches[0]).run(list(range(len(positions))), ids, positions)  # [B, V]
    rows = len(positions)
    device = tiny_model.device
    dynamic = tiny_model(
        torch.tensor(ids, device=device)[:, None], torch.tensor(positions, device=device)[:, None], caches[1],
        caches[1].batch(list(range(rows))), kv_length=max(positions) + 1,
    ).logits[:, -1]  # [B, V]
    torch.testing.assert_close(static, dynamic, rtol=0, atol=LOGIT_TOLERANCE)


def admission_beside_a_padded_decode(engine) -> tuple[dict, list[int]]:
    """Three rows decode on slots 0-2 while a new request is prefilled into slot 3 in the same
    step (with static decode, padded to four rows: the fourth writes into slot 3)."""
    runs = []
    if engine.core.runner.static_decode is not None:
        real_run = engine.core.runner.static_decode.run
        engine.core.runner.static_decode.run = lambda slots, ids, positions, *rest: (runs.append(len(ids)), real_run(slots, ids, positions, *rest))[1]
    first = [make_request(random_prompt(6, seed=s), request_id=f"first-{s}", max_new_tokens=8) for s in (1, 2, 3)]
    engine.submit(first)
    results = {f.request_id: f for f in engine.step().finished}
    engine.submit([make_request(random_prompt(5, seed=4), request_id="late", max_new_tokens=8)])
    results.update((f.request_id, f) for f in engine.step().finished)
    results.update((f.request_id, f) for f in run_until_idle(engine))
    return results, runs


def test_a_request_admitted_into_a_padded_slot_keeps_its_prompt(make_engine, hf_model):
    static, runs = admission_beside_a_padded_decode(make_engine(max_slots=4, static_decode=True))
    dynamic, _ = admission_beside_a_padded_decode(make_engine(max_slots=4))
    assert runs[0] == 3  # the step that admitted "late" decoded 3 rows padded to 4
    assert set(static) == set(dynamic) == {"first-1", "first-2", "first-3", "late"}
    for request_id, result in static.items():
        ours, reference = result.sequences[0], dynamic[request_id].sequences[0]
        assert ours.token_ids == reference.token_ids, request_id
        torch.testing.assert_close(ours.logprobs, reference.logprobs, rtol=0, atol=LOGIT_TOLERANCE)
    late = static["late"].sequences[0].token_ids
    assert late == hf_generate(hf_model, random_prompt(5, seed=4), 8)


class RecordingGraph:
    """Stands in for a captured graph: replaying it records whether the device's block tables
    (what a graph reads, with no Python of the cache's running) match the host's."""

    def __init__(self, cache: KVCache) -> None:
        self.cache, self.tables_seen = cache, []

    def replay(self) -> None:
        self.tables_seen.append(torch.equal(self.cache.device_tables, torch.from_numpy(self.cache.tables)))


def test_a_replayed_graph_reads_the_block_tables_the_scheduler_last_wrote(tiny_model):
    cache = KVCache(TINY, 4, TINY.n_positions, device=tiny_model.device)
    # A GPU's layout on the CPU: the forward reads a device copy of the tables, not the host array.
    cache._shared_tables, cache.device_tables = False, torch.from_numpy(cache.tables.copy())
    decode = StaticDecode(tiny_model, cache)
    graph = RecordingGraph(cache)
    logits = torch.zeros(2, TINY.vocab_size)
    decode.graphs[(2, decode.length_buckets[0])] = (graph, logits)
    slots = cache.allocate(2, tokens=20)  # the tables change after the last forward
    decode.run(slots, [1, 2], [19, 19])
    cache.ensure(slots[1], 40)  # a row crosses into a new block
    decode.run(slots, [3, 4], [20, 39])
    assert graph.tables_seen == [True, True]


class EagerGraph:
    """Stands in for a captured graph by running the static forward eagerly into its output,
    noting the rows' first blocks (SCRATCH: a row without blocks of its own)."""

    def __init__(self, decode: StaticDecode, size: int, bucket: int) -> None:
        self.decode, self.size, self.bucket, self.first_blocks = decode, size, bucket, []
        self.logits = torch.zeros(size, TINY.vocab_size, device=decode.model.device)  # where a graph's output lives

    def replay(self) -> None:
        self.first_blocks.append(self.decode.cache.tables[: self.size, 0].tolist())
        self.logits.copy_(self.decode._forward(self.size, self.bucket))


def test_the_capture_check_gives_its_rows_blocks_of_their_own_and_gives_them_back(tiny_model):
    # Rows without blocks all write the one scratch block, in an order a GPU does not fix: the
    # graph and the eager forward could then read different keys and the check fail by chance.
    cache = KVCache(TINY, 4, TINY.n_positions, device=tiny_model.device)
    decode = StaticDecode(tiny_model, cache)
    fakes = {}
    for size, bucket in [(decode.batch_sizes[0], decode.length_buckets[0]), (decode.batch_sizes[-1], decode.length_buckets[-1])]:
        fakes[size] = EagerGraph(decode, size, bucket)
        decode.graphs[(size, bucket)] = (fakes[size], fakes[size].logits)
    decode._check()
    assert all(SCRATCH not in seen for fake in fakes.values() for seen in fake.first_blocks)
    assert [len(fake.first_blocks) for fake in fakes.values()] == [1, 1]
    assert cache.slots_used == 0 and cache.blocks_free == cache.num_blocks
