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
    # The finished streams kept their prefixes; two long prompts then take their blocks.
    before = engine.scheduler.prefix.evictions
    stats = step_stats(engine, [make_request(random_prompt(100, seed=90 + i), max_new_tokens=2) for i in range(2)])
    assert sum(s.prefix_evictions for s in stats) == engine.scheduler.prefix.evictions - before > 0
    again = step_stats(engine, [make_request(random_prompt(100, seed=90), max_new_tokens=2)])
    assert sum(s.prefix_hits for s in again) == 1


def test_the_counts_are_metrics_series(make_engine):
    engine = make_engine(max_slots=8, kv_cache_sequences=2)
    metrics = Metrics()
    for stats in step_stats(engine, burst()):
        metrics.observe_step(stats)
    text = generate_latest(metrics.registry).decode()
    assert f"gpt2_kv_preemptions_total {float(engine.scheduler.preemptions)}" in text
    assert "gpt2_prefix_cache_hits_total 0.0" in text and "gpt2_prefix_cache_evictions_total" in text
