"""The KV cache's memory budget through the engine: max_slots bounds the sequences running, the
budget (blocks) their tokens. More short streams than full-length slots decode together; a prompt
waits for blocks; cached blocks are evicted least recently freed first; every token as with the default cache."""

from __future__ import annotations

import pytest

from tests.conftest import TINY
from tests.engine.conftest import make_request, random_prompt, run_until_idle

FULL_ROW_BLOCKS = TINY.n_positions // 16  # blocks of one full-length sequence


def streams(count: int, prompt: int, new: int, seed: int = 0) -> list:
    return [make_request(random_prompt(prompt, seed=seed + i), request_id=f"s{i}", max_new_tokens=new)
            for i in range(count)]


def tokens(results) -> dict[str, list[list[int]]]:
    return {r.request_id: [s.token_ids for s in r.sequences] for r in results}


def run_recording(engine, requests) -> tuple[dict, list]:
    """Submit, step to the end; the results and each step's stats."""
    engine.submit(requests)
    results, stats = [], []
    while engine.has_work():
        output = engine.step()
        results += output.finished
        stats.append(output.stats)
    return tokens(results), stats


def test_more_short_streams_than_full_length_slots_decode_together(make_engine):
    # Two full-length sequences' bytes, eight rows: eight streams of 16 + 16 tokens fit at once.
    engine = make_engine(max_slots=8, kv_cache_sequences=2)
    assert engine.cache.num_blocks == 2 * FULL_ROW_BLOCKS
    ours, stats = run_recording(engine, streams(8, 16, 16))
    assert max(s.decode_tokens for s in stats) == 8
    assert ours == tokens(make_engine(max_slots=8).generate(streams(8, 16, 16)))


def test_a_prompt_waits_for_blocks_and_runs_when_they_free(make_engine):
    # Three full-length sequences' blocks (24); each request holds 7 (100 prompt + 10 new tokens).
    engine = make_engine(max_slots=8, kv_cache_sequences=3, prefix_caching=False)
    ours, stats = run_recording(engine, streams(5, 100, 10, seed=10))
    assert max(s.running for s in stats) == 3  # rows were free; blocks were not
    assert any(s.waiting for s in stats) and len(ours) == 5
    assert ours == tokens(make_engine(max_slots=8, prefix_caching=False).generate(streams(5, 100, 10, seed=10)))


def test_cached_blocks_are_evicted_only_under_pressure_least_recently_freed_first(make_engine):
    engine = make_engine(max_slots=8, kv_cache_sequences=2)  # 16 blocks
    prompts = [random_prompt(60, seed=70 + i) for i in range(3)]
    for i, prompt in enumerate(prompts):  # each leaves 3 full blocks cached, its 4th free
        engine.submit([make_request(prompt, request_id=f"k{i}", max_new_tokens=2)])
        run_until_idle(engine)
    pool = engine.cache.pool
    assert (pool.cached_free_count, engine.cache.blocks_free) == (9, 16)
    # A prompt of 20 tokens (2 blocks) finds 7 uncached blocks free: nothing is evicted.
    run_recording(engine, [make_request(random_prompt(20, seed=98), request_id="small", max_new_tokens=2)])
    assert pool.evictions == 0 and pool.cached_free_count == 10  # (its own first block, cached)
    # 120 + 4 tokens need 8 blocks: 6 uncached free, so the two least recently freed cached
    # ones go: k0's last two full blocks (a sequence's last blocks are freed first).
    ours, _ = run_recording(engine, [make_request(random_prompt(120, seed=99), request_id="big", max_new_tokens=4)])
    assert pool.evictions == 2
    hits = [engine.scheduler.prefix.match(prompt, None) for prompt in prompts]
    assert [match.length for match in hits] == [16, 48, 48]
    cold = make_engine(max_slots=8, prefix_caching=False).generate(
        [make_request(random_prompt(120, seed=99), request_id="big", max_new_tokens=4)])
    assert ours == tokens(cold)


def test_a_request_larger_than_the_whole_cache_is_refused(make_engine):
    engine = make_engine(max_slots=8, kv_cache_sequences=1)
    with pytest.raises(ValueError, match="KV-cache blocks"):
        engine.submit([make_request(random_prompt(10, seed=1), max_new_tokens=100, do_sample=True,
                                    num_return_sequences=2)])


def test_samples_of_one_prompt_share_its_blocks_and_draw_as_requests_alone(make_engine):
    """n samples fork the prompt's blocks (prefilled once); sample i draws what a request alone
    with its seed draws, over the same keys."""
    from service.engine.admission import SEED_MODULUS, SEED_STRIDE

    prompt = random_prompt(70, seed=5)  # 5 blocks, the last one partly filled
    params = dict(do_sample=True, temperature=0.9, max_new_tokens=12)
    engine = make_engine(max_slots=8)
    peak, prefilled, results = 0, 0, []
    engine.submit([make_request(prompt, request_id="n4", seed=3, num_return_sequences=4, **params)])
    while engine.has_work():
        output = engine.step()
        prefilled += output.stats.prefill_tokens
        results += output.finished
        cache = engine.cache
        held = [cache.blocks_of(row) for row in range(cache.max_slots) if cache.in_use[row]]
        assert all(blocks[:4] == held[0][:4] for blocks in held)  # the prompt's 4 full blocks, shared
        peak = max(peak, len({b for blocks in held for b in blocks}))
    # The prompt once; each sample its own copy of the prompt's partial last block and the block
    # after it (position 80 on, taken in the last step: with overlap that step is seen before it
    # ends). Copies of the whole prompt would be 4 x 6 blocks.
    assert prefilled == 70 and peak <= 4 + 2 * 4
    alone = make_engine(max_slots=8).generate([
        make_request(prompt, request_id=f"alone-{i}", seed=(3 + i * SEED_STRIDE) % SEED_MODULUS, **params)
        for i in range(4)])
    assert [s.token_ids for s in results[0].sequences] == [r.sequences[0].token_ids for r in alone]


def test_a_prompt_extending_a_running_sequence_shares_its_full_blocks(make_engine):
    """No copy of a running sequence's prefix: its full blocks are shared, registered as it was
    prefilled; the new prompt computes the rest in a block of its own. (In a pool short of a home
    for every row, where sharing saves the bytes; with homes, the CPU copies them home.)"""
    context = random_prompt(40, seed=41)  # blocks 0 and 1 full, block 2 partly
    engine = make_engine(max_slots=8, kv_cache_sequences=7)
    engine.submit([make_request(context, request_id="stream", max_new_tokens=20)])
    for _ in range(3):
        engine.step()
    engine.submit([make_request(context + [5, 6], request_id="extends", max_new_tokens=6)])
    assert engine.step().stats.cached_prompt_tokens == 32
    stream, extends = engine.scheduler.running
    ours, theirs = (engine.cache.blocks_of(s.sequences[0].slot) for s in (stream, extends))
    assert ours[:2] == theirs[:2] and ours[2] != theirs[2]
    results = {f.request_id: f.sequences[0].token_ids for f in run_until_idle(engine)}
    cold = make_engine(max_slots=8, prefix_caching=False).generate(
        [make_request(context, request_id="stream", max_new_tokens=20),
         make_request(context + [5, 6], request_id="extends", max_new_tokens=6)])
    assert results == {f.request_id: f.sequences[0].token_ids for f in cold}


def test_the_budget_in_bytes_sets_the_pool(make_engine):
    per_block = 16 * 2 * TINY.n_layer * TINY.n_embd * 4  # float32 keys and values of 16 positions
    assert make_engine(kv_cache_bytes=10 * per_block + per_block // 2).cache.num_blocks == 10
    assert make_engine(max_slots=3).cache.num_blocks == 3 * FULL_ROW_BLOCKS  # default: max_slots full rows
    with pytest.raises(ValueError, match="holds no block"):
        make_engine(kv_cache_bytes=per_block - 1)


def test_on_a_gpu_the_budget_is_a_fraction_of_free_memory_capped_at_full_rows():
    """vLLM's --gpu-memory-utilization, of the memory free after the weights: a fraction of a
    small free memory is the pool; a fraction of a large one stops at max_slots full rows; bytes
    given win; without free memory known (the CPU) the sequences' default holds."""
    import torch

    from model.block_tables import blocks_for
    from model.kv_cache import bytes_per_token
    from service.engine.core import EngineConfig, kv_blocks

    per_block = bytes_per_token(TINY, torch.float16) * 16
    full_rows = 8 * blocks_for(TINY.n_positions)
    config = EngineConfig(max_slots=8, kv_cache_fraction=0.5, kv_cache_sequences=2)
    assert kv_blocks(config, TINY.n_positions, TINY, torch.float16, free_bytes=20 * per_block) == 10
    assert kv_blocks(config, TINY.n_positions, TINY, torch.float16, free_bytes=10**12) == full_rows
    assert kv_blocks(config, TINY.n_positions, TINY, torch.float16) == 2 * FULL_ROW_BLOCKS
    given = EngineConfig(max_slots=8, kv_cache_bytes=3 * per_block, kv_cache_fraction=0.5)
    assert kv_blocks(given, TINY.n_positions, TINY, torch.float16, free_bytes=10**12) == 3


def test_the_service_takes_a_fraction_of_free_memory_on_cuda_and_sequences_on_cpu():
    from service.app import core_config
    from service.settings import Settings

    on_gpu = core_config(Settings(device="cuda", kv_cache_memory_fraction=0.7), 1024, 50256).engine
    on_cpu = core_config(Settings(device="cpu"), 1024, 50256).engine
    assert on_gpu.kv_cache_fraction == 0.7 and on_cpu.kv_cache_fraction is None
    assert on_cpu.kv_cache_sequences == 16


def test_the_free_memory_a_fraction_takes_is_the_gpus_and_none_elsewhere(monkeypatch):
    """What EngineCore asks on a GPU before sizing its pool (on the CPU nothing is asked)."""
    import torch

    from service.engine.core import device_free_bytes

    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (asked.append(device), (7 << 30, 80 << 30))[1])
    assert device_free_bytes(torch.device("cpu")) is None and asked == []
    assert device_free_bytes(torch.device("cuda", 0)) == 7 << 30 and asked == [torch.device("cuda", 0)]
