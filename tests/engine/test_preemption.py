"""Preemption by recompute: when decoding rows need blocks the pool no longer has, the youngest
running request goes back to the front of the queue with its generated tokens, is prefilled
again from them and decodes on. Nobody fails; every answer is the one an ample cache gives."""

from __future__ import annotations

from service.engine.block_room import recomputable
from tests.engine.conftest import make_request, random_prompt, run_until_idle


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
    preemption continue the same stream. Keys a prefill recomputes (those of blocks evicted
    meanwhile, and of the last partial one) may differ from those decoding wrote in their last
    bits (docs/batch-invariance.md), and this tiny model's flat distributions put a draw on a
    cut-off at once: the tokens up to the preemption are compared, and the requests never
    preempted throughout (an exact continuation: the test below)."""
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
        agreed = preempted[request_id] if request_id in preempted else None
        assert tokens[0][:agreed] == ample[request_id][0][:agreed], request_id


def test_a_preempted_sequence_finding_its_blocks_cached_goes_on_bit_for_bit(make_engine):
    """Preempted as it crosses into a new block (where the pool runs short), a sequence has
    written whole blocks; they stay cached, so its recompute prefills nothing and it decodes on
    over the very keys it wrote: every token and log-prob as if never preempted."""
    params = dict(do_sample=True, seed=5, temperature=0.8, top_k=50, max_new_tokens=30)
    engine = make_engine(max_slots=8, overlap=False)  # (with overlap a token is in flight)
    engine.submit([make_request(random_prompt(20, seed=80), request_id="p", **params)])
    while not (engine.scheduler.running and engine.scheduler.running[0].sequences[0].cached == 32):
        engine.step()
    [state] = engine.scheduler.running
    engine.scheduler._preempt(state)
    stats = engine.step().stats
    assert (stats.cached_prompt_tokens, stats.prefill_tokens, engine.scheduler.preemptions) == (32, 0, 1)
    [ours] = run_until_idle(engine)
    [alone] = make_engine(max_slots=8, overlap=False).generate([make_request(random_prompt(20, seed=80), **params)])
    assert ours.sequences[0].token_ids == alone.sequences[0].token_ids
    assert ours.sequences[0].logprobs == alone.sequences[0].logprobs


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
