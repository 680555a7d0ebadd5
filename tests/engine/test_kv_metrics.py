"""The KV cache's counts reach the step's stats and /metrics: prefix-cache hits and evictions,
preemptions, the block pool's use."""

from __future__ import annotations

from prometheus_client import generate_latest

from service.common.metrics import Metrics
from tests.engine.conftest import make_request, random_prompt
from tests.engine.test_preemption import burst


def step_stats(engine, requests) -> list:
    engine.submit(requests)
    stats = []
    while engine.has_work():
        stats.append(engine.step().stats)
    return stats


def test_preemptions_evictions_and_hits_are_counted_once_each(make_engine):
    engine = make_engine(max_slots=8, kv_cache_sequences=2)
    stats = step_stats(engine, burst())
    assert sum(s.preemptions for s in stats) == engine.scheduler.preemptions > 0
    assert max(s.kv_blocks_used for s in stats) == engine.cache.num_blocks == stats[0].kv_blocks_total
    # The finished streams' blocks stay cached; two long prompts then take them.
    before = engine.scheduler.prefix.evictions
    stats = step_stats(engine, [make_request(random_prompt(100, seed=90 + i), max_new_tokens=2) for i in range(2)])
    assert sum(s.prefix_evictions for s in stats) == engine.scheduler.prefix.evictions - before > 0
    again = step_stats(engine, [make_request(random_prompt(100, seed=90), max_new_tokens=2)])
    assert sum(s.prefix_hits for s in again) == 6  # blocks: the prompt's 99 reusable tokens hold 6 full ones


def test_the_counts_are_metrics_series(make_engine):
    engine = make_engine(max_slots=8, kv_cache_sequences=2)
    metrics = Metrics()
    stats = step_stats(engine, burst())
    for step in stats:
        metrics.observe_step(step)
    text = generate_latest(metrics.registry).decode()
    assert f"gpt2_kv_preemptions_total {float(engine.scheduler.preemptions)}" in text
    # A preempted stream's recompute shares the blocks it left cached.
    hits = sum(step.prefix_hits for step in stats)
    assert hits > 0 and f"gpt2_prefix_cache_hits_total {float(hits)}" in text
    assert f"gpt2_prefix_cache_evictions_total {float(engine.scheduler.prefix.evictions)}" in text
