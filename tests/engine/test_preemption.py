"""Preemption by recompute: when decoding rows need blocks the pool no longer has, the youngest
running request goes back to the front of the queue with its generated tokens, is prefilled
again from them and decodes on. Nobody fails; every answer is the one an ample cache gives."""

from __future__ import annotations

from service.engine.block_room import recomputable
from tests.engine.conftest import make_request, random_prompt


def burst(**params) -> list:
    """Four streams of 20 + 60 tokens (5 blocks each at the end): 20 blocks, in a pool of 16."""
    return [make_request(random_prompt(20, seed=80 + i), request_id=f"b{i}", max_new_tokens=60, ignore_eos=True,
                         **params) for i in range(4)]


def run(engine, requests) -> tuple[dict, list]:
    engine.submit(requests)
    results, stats = {}, []
    while engine.has_work():
        output = engine.step()
        assert not output.failed
        results.update((f.request_id, [s.token_ids for s in f.sequences]) for f in output.finished)
        stats.append(output.stats)
    return results, stats


def test_a_burst_of_long_generations_slows_down_instead_of_failing(make_engine):
    engine = make_engine(max_slots=8, kv_cache_sequences=2, prefix_caching=False)
    ours, stats = run(engine, burst())
    assert engine.scheduler.preemptions > 0
    assert max(s.decode_tokens for s in stats) == 4  # all four decoded together before blocks ran out
    assert any(s.waiting for s in stats[1:])  # a preempted one waited
    ample, _ = run(make_engine(max_slots=8, prefix_caching=False), burst())
    assert ours == ample


def test_seeded_samples_go_on_from_where_a_preemption_left_them(make_engine):
    """A seeded draw depends on the sequence's seed and length alone, so the draws after the
    preemption continue the same stream. The keys recomputed by a prefill may differ from those
    decoding wrote in their last bits (docs/batch-invariance.md), so only the first draws after
    it are compared; the requests never preempted match throughout."""
    params = dict(do_sample=True, seed=5, temperature=0.8, top_k=50)
    engine = make_engine(max_slots=8, kv_cache_sequences=2)
    preempted = {}
    real_preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda state: (preempted.setdefault(state.request.request_id, len(state.sequences[0].generated)),
                                                real_preempt(state))
    ours, _ = run(engine, burst(**params))
    ample, _ = run(make_engine(max_slots=8), burst(**params))
    assert preempted
    for request_id, tokens in ours.items():
        agreed = preempted[request_id] + 3 if request_id in preempted else None
        assert tokens[0][:agreed] == ample[request_id][0][:agreed], request_id


def test_only_requests_recomputable_from_their_tokens_are_preempted(make_engine):
    engine = make_engine(max_slots=8)
    engine.submit([make_request([1, 2, 3], request_id="plain", max_new_tokens=4),
                   make_request([1, 2, 3], request_id="penalised", max_new_tokens=4, repetition_penalty=1.2),
                   make_request([1, 2, 3], request_id="samples", max_new_tokens=4, do_sample=True,
                                num_return_sequences=2)])
    engine.step()
    plain, penalised, samples = engine.scheduler.running
    # With overlap their first decode's token is in flight: recomputable once it is read.
    assert recomputable(plain, once_read=True)
    assert not recomputable(penalised, once_read=True) and not recomputable(samples, once_read=True)
    assert recomputable(plain) == (plain.sequences[0].pending == 0)
