"""Prefix caching and chunked prefill change nothing a client can see.

Each test runs the same requests through an engine that reuses cached prefixes and prefills in
chunks and through a cold one (no cache, whole prompts): greedy tokens and seeded samples are
identical, log-probabilities and prompt scores equal within 1e-5 (float32), and the stats show
the reuse or the chunks really happened (so a test cannot pass by never reusing anything).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from model.block_pool import BlockPool
from model.block_tables import BLOCK_SIZE
from model.lora import BASE
from service.engine import faults
from service.engine.prefix_cache import ROOT, block_key, common_prefix_length
from tests.engine.conftest import hf_generate, make_request, random_prompt, run_until_idle

TOLERANCE = 1e-5  # float32: the same arithmetic over a different split of the positions
CONTEXT = random_prompt(40, seed=40)


def cold_engine(make_engine, **config):
    return make_engine(prefix_caching=False, max_prefill_tokens=4096, **config)


def run(engine, requests) -> dict:
    """Submit each request in its own step (later ones find the earlier ones cached)."""
    results = {}
    for request in requests:
        engine.submit([request])
        results.update((f.request_id, f) for f in run_until_idle(engine))
    return results


def assert_same(ours, cold) -> None:
    assert ours.keys() == cold.keys()
    for request_id, result in ours.items():
        reference = cold[request_id]
        for seq, ref in zip(result.sequences, reference.sequences, strict=True):
            assert seq.token_ids == ref.token_ids, request_id
            torch.testing.assert_close(seq.logprobs, ref.logprobs, rtol=0, atol=TOLERANCE)
        if reference.prompt_scores is not None:
            ps, ref = result.prompt_scores, reference.prompt_scores
            assert [[t for t, _ in top or []] for top in ps.top] == [[t for t, _ in top or []] for top in ref.top]
            # A rank counts the tokens scored above the target: a neighbour within float32 noise of
            # it (among 50,257 logits, deep in the ranking) may land on either side.
            assert all(abs(a - b) <= 2 for a, b in zip(ps.ranks[1:], ref.ranks[1:], strict=True))
            torch.testing.assert_close(ps.logprobs[1:], ref.logprobs[1:], rtol=0, atol=TOLERANCE)
            torch.testing.assert_close(
                [lp for top in ps.top[1:] for _, lp in top], [lp for top in ref.top[1:] for _, lp in top],
                rtol=0, atol=TOLERANCE,
            )


def cached_tokens(engine, request) -> int:
    """Submit one request and step it to the end; prompt tokens its admission reused."""
    engine.submit([request])
    reused = 0
    while engine.has_work():
        reused += engine.step().stats.cached_prompt_tokens
    return reused


# --- the keys and the pool ------------------------------------------------------------------------
def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([5], [6]) == 0
    assert common_prefix_length(list(range(1000)), list(range(999)) + [0]) == 999


def test_a_block_key_names_its_tokens_everything_before_them_and_the_adapter():
    tokens = list(range(16))
    key = block_key(ROOT, tokens, BASE)
    assert key == block_key(ROOT, list(tokens), BASE)
    assert key != block_key(ROOT, tokens[:15] + [99], BASE)
    assert key != block_key(ROOT, tokens, 0)  # an adapter's keys and values differ
    # The same 16 tokens after different prefixes: different keys.
    assert block_key(key, tokens, BASE) != block_key(block_key(ROOT, [7] * 16, BASE), tokens, BASE)


def test_free_cached_blocks_are_evicted_least_recently_freed_first_only_under_pressure():
    pool = BlockPool(4)
    first, second, third = (pool.take() for _ in range(3))
    for block, key in zip((first, second, third), "abc"):
        pool.register(block, key)
    pool.let_go([first])
    pool.let_go([second, third])  # a sequence's blocks: its last one is the sooner evicted
    assert pool.free_count == 4 and pool.cached_free_count == 3
    assert pool.take() == 4 and pool.evictions == 0  # an uncached free block first
    pool.hold([second])  # shared again: no longer free
    assert [pool.take(), pool.take()] == [first, third] and pool.evictions == 2
    assert (pool.lookup("a"), pool.lookup("b"), pool.lookup("c")) == (None, second, None)
    assert pool.free_count == 0
    pool.let_go([second])
    pool.forget([second])  # a failed sequence's: plainly free, found no more
    assert pool.lookup("b") is None and pool.cached_free_count == 0 and pool.free_count == 1


def test_a_block_wanted_where_a_prefix_is_cached_has_the_prefix_moved_not_dropped():
    pool = BlockPool(4)
    block = pool.take()
    pool.register(block, "a")
    pool.let_go([block])
    spare = pool.relocate(block)  # a row wants that block: its key moves to a free one
    assert spare == 2 and pool.lookup("a") == spare and pool.cached_free_count == 1
    assert pool.take(block, evict_wanted=True) == block and pool.evictions == 0 and pool.free_count == 3
    assert pool.relocate(spare) == 3 and pool.lookup("a") == 3
    pool.take(), pool.take()  # no uncached block is free: nothing to move it to
    assert pool.relocate(3) is None and pool.take(3, evict_wanted=True) == 3 and pool.lookup("a") is None


def test_a_row_growing_into_its_home_keeps_the_prefix_cached_there(make_engine):
    """lm-evaluation-harness's multiple choice: a context's first choice ends, another client's
    request takes that row and grows into its home blocks, then the next choice arrives. The
    context is still found (moved aside, not evicted), and everything equals a cold run."""
    context = random_prompt(70, seed=70)  # four full blocks
    engine = make_engine(max_slots=4)
    assert engine.cache.homes == (engine.cache.device.type == "cpu")  # where reads are views
    first = make_request(context + [5], request_id="first", max_new_tokens=2, prompt_logprobs=True)
    other = make_request(random_prompt(80, seed=80), request_id="other", max_new_tokens=3, prompt_logprobs=True)
    second = make_request(context + [9, 8], request_id="second", max_new_tokens=2, prompt_logprobs=True)
    results = run(engine, [first, other])
    engine.submit([second])
    reused = 0
    while engine.has_work():
        output = engine.step()
        reused += output.stats.cached_prompt_tokens
        results.update((f.request_id, f) for f in output.finished)
    assert reused == 64 and engine.cache.pool.evictions == 0
    assert_same(results, run(cold_engine(make_engine, max_slots=4), [first, other, second]))


# --- exactness through the engine ----------------------------------------------------------------
def test_a_prompt_extending_a_finished_one_reuses_it_and_decodes_the_same(make_engine, hf_model):
    first = make_request(CONTEXT, request_id="first", max_new_tokens=6)
    follow_up = CONTEXT + random_prompt(9, seed=9)
    engine = make_engine()
    run(engine, [first])
    second = make_request(follow_up, request_id="second", max_new_tokens=8)
    assert cached_tokens(engine, second) == 32  # the context's full blocks (the first's 46 tokens: 2)
    [result] = run(engine, [make_request(follow_up, request_id="third", max_new_tokens=8)]).values()
    assert result.sequences[0].token_ids == hf_generate(hf_model, follow_up, 8)
    warm = run(make_engine(), [first, make_request(follow_up, request_id="second", max_new_tokens=8)])
    cold = run(cold_engine(make_engine), [first, make_request(follow_up, request_id="second", max_new_tokens=8)])
    assert_same(warm, cold)


@pytest.mark.parametrize("length", [40, 48])
def test_a_repeated_prompt_computes_only_its_last_partial_block(make_engine, length):
    """Whole blocks are shared, and the last token is always computed: a prompt of 40 tokens
    computes 8 again, one of 48 (three full blocks) its last block's 16."""
    prompt = random_prompt(length, seed=length)
    engine = make_engine()
    run(engine, [make_request(prompt, max_new_tokens=3)])
    engine.submit([make_request(prompt, request_id="again", max_new_tokens=3)])
    first_step = engine.step().stats
    shared = (length - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert (first_step.prefill_tokens, first_step.cached_prompt_tokens) == (length - shared, shared)
    assert first_step.prefix_hits == shared // BLOCK_SIZE


def assert_counted(cache) -> None:
    """Each block's refcount is the number of rows listing it; the free blocks are the others."""
    held = Counter(block for row in range(cache.max_slots) if cache.in_use[row] for block in cache.blocks_of(row))
    assert all(cache.refs[block] == count for block, count in held.items())
    assert cache.blocks_free == cache.num_blocks - len(held) and int(cache.refs.sum()) == sum(held.values())


def test_concurrent_requests_sharing_a_long_prefix_hold_one_copy_of_its_blocks(make_engine):
    shared = random_prompt(96, seed=96)  # six full blocks
    requests = lambda: [  # noqa: E731
        make_request(shared + random_prompt(5, seed=s), request_id=f"r{s}", max_new_tokens=8) for s in range(3)]
    engine = make_engine(max_slots=4, kv_cache_sequences=3)  # short of homes: shared, not copied home
    engine.submit(requests())
    computed, together, results = 0, 0, {}
    while engine.has_work():
        output = engine.step()
        computed += output.stats.prefill_tokens
        results.update((f.request_id, f) for f in output.finished)
        assert_counted(engine.cache)  # (one finishing lets go of the prefix; the others still hold it)
        running = [state for state in engine.scheduler.running if not state.prefilling]
        if len(running) == 3:
            together += 1
            tables = [engine.cache.blocks_of(state.sequences[0].slot) for state in running]
            assert all(table[:6] == tables[0][:6] for table in tables)  # one copy of the prefix
            assert len({block for table in tables for block in table}) == 6 + 3  # each its own last block
    assert together > 0
    assert computed == 101 + 2 * 5  # the others waited for the first, then shared its blocks
    assert_same(results, run(cold_engine(make_engine), requests()))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_seeded_sampling_is_identical_with_a_reused_prefix(make_engine, seed):
    params = dict(do_sample=True, seed=seed, temperature=0.9, top_p=0.95, max_new_tokens=12, num_return_sequences=2)
    requests = lambda: [  # noqa: E731 (fresh objects for each engine)
        make_request(CONTEXT + [7, 8], request_id="a", **params),
        make_request(CONTEXT + [9], request_id="b", **params),
        make_request(CONTEXT, request_id="c", repetition_penalty=1.3, no_repeat_ngram_size=2, **params),
    ]
    assert_same(run(make_engine(), requests()), run(cold_engine(make_engine), requests()))


def test_prompt_scores_reuse_the_kept_ones_and_equal_a_cold_run(make_engine):
    scoring = dict(max_new_tokens=1, prompt_logprobs=True, top_logprobs=3)
    choices = [random_prompt(4 + i, seed=100 + i) for i in range(4)]
    requests = lambda: [make_request(CONTEXT + c, request_id=f"choice-{i}", **scoring) for i, c in enumerate(choices)]  # noqa: E731
    engine = make_engine()
    warm = run(engine, requests()[:1])
    reused = [cached_tokens(engine, r) for r in requests()[1:]]
    assert reused == [32] * 3  # the context's full blocks, with their tokens' scores kept
    warm.update(run(make_engine(), requests()))
    assert_same(warm, run(cold_engine(make_engine), requests()))
    # Fewer alternatives than were kept: reused; more: computed again, still exact.
    fewer = make_request(CONTEXT + [3], request_id="fewer", max_new_tokens=1, prompt_logprobs=True, top_logprobs=1)
    more = make_request(CONTEXT + [3], request_id="more", max_new_tokens=1, prompt_logprobs=True, top_logprobs=5)
    assert cached_tokens(engine, fewer) > 0 and cached_tokens(engine, more) == 0


def test_prompts_of_one_submission_share_their_context(make_engine):
    """lm-eval's multiple choice in one request: the context is computed once, not four times."""
    choices = [random_prompt(3 + i, seed=200 + i) for i in range(4)]
    requests = lambda: [  # noqa: E731
        make_request(CONTEXT + c, request_id=f"c{i}", max_new_tokens=2, prompt_logprobs=True) for i, c in enumerate(choices)
    ]
    engine = make_engine()
    engine.submit(requests())
    results, computed = {}, 0
    while engine.has_work():
        output = engine.step()
        computed += output.stats.prefill_tokens
        results.update((f.request_id, f) for f in output.finished)
    assert computed == sum(len(CONTEXT) + len(c) for c in choices) - 3 * 32  # the context's full blocks once
    cold = cold_engine(make_engine)
    assert_same(results, {r.request_id: f for r, f in zip(requests(), cold.generate(requests()))})


def test_beams_and_several_samples_start_from_a_reused_prefix(make_engine):
    requests = lambda: [  # noqa: E731
        make_request(CONTEXT, request_id="warm-up", max_new_tokens=2),
        make_request(CONTEXT + [11, 12], request_id="beams", max_new_tokens=6, num_beams=3, num_return_sequences=2),
        make_request(CONTEXT + [13], request_id="samples", max_new_tokens=6, do_sample=True, seed=5, num_return_sequences=3),
    ]
    warm, cold = run(make_engine(), requests()), run(cold_engine(make_engine), requests())
    for request_id in ("beams", "samples"):
        assert [s.token_ids for s in warm[request_id].sequences] == [s.token_ids for s in cold[request_id].sequences]
    assert_same({"samples": warm["samples"]}, {"samples": cold["samples"]})


def test_evicted_prefixes_are_computed_again_and_nothing_changes(make_engine):
    config = dict(max_slots=2, kv_cache_sequences=1)  # 8 blocks: each prompt's evicts the one before
    engine = make_engine(**config)
    prompts = [random_prompt(60, seed=300 + i) for i in range(3)]
    for i, prompt in enumerate(prompts):
        run(engine, [make_request(prompt, request_id=f"fill-{i}", max_new_tokens=40)])
    assert engine.scheduler.prefix.evictions > 0
    assert cached_tokens(engine, make_request(prompts[0], max_new_tokens=2)) == 0
    requests = lambda: [make_request(p + [1], request_id=f"again-{i}", max_new_tokens=5) for i, p in enumerate(prompts)]  # noqa: E731
    assert_same(run(engine, requests()), run(cold_engine(make_engine, **config), requests()))


# --- chunked prefill --------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [1, 7, 16])
def test_a_long_prompt_in_chunks_decodes_as_in_one_piece(make_engine, hf_model, budget):
    prompt = random_prompt(50, seed=50)
    scoring = dict(max_new_tokens=6, prompt_logprobs=True, top_logprobs=2)
    engine = make_engine(max_prefill_tokens=budget)
    engine.submit([make_request(prompt, request_id="long", **scoring)])
    steps = 0
    while engine.has_work():
        assert engine.step().stats.prefill_tokens <= budget
        steps += 1
    assert steps >= -(-len(prompt) // budget)
    warm = run(make_engine(max_prefill_tokens=budget, prefix_caching=False), [make_request(prompt, request_id="x", **scoring)])
    cold = run(cold_engine(make_engine), [make_request(prompt, request_id="x", **scoring)])
    assert_same(warm, cold)
    assert warm["x"].sequences[0].token_ids == hf_generate(hf_model, prompt, 6)


def test_running_streams_keep_decoding_while_a_long_prompt_arrives(make_engine):
    engine = make_engine(max_slots=4, max_prefill_tokens=16)
    streams = [make_request(random_prompt(5, seed=s), request_id=f"s{s}", max_new_tokens=30) for s in range(3)]
    engine.submit(streams)
    engine.step()
    engine.submit([make_request(random_prompt(100, seed=7), request_id="long", max_new_tokens=2)])
    for _ in range(100 // 16):  # every step of the arrival gives each stream a token
        output = engine.step()
        assert sorted(e.request_id for e in output.events) == ["s0", "s1", "s2"]
        assert 0 < output.stats.prefill_tokens <= 16
    results = {f.request_id: f for f in run_until_idle(engine)}
    cold = {r.request_id: f for r, f in zip(streams, cold_engine(make_engine).generate(
        [make_request(random_prompt(5, seed=s), request_id=f"s{s}", max_new_tokens=30) for s in range(3)]))}
    assert_same({k: results[k] for k in cold}, cold)


def test_chunk_boundaries_inside_multibyte_characters(make_engine, tokenizer):
    prompt = tokenizer.encode("日本語の文章🙂 and ünïcödé 🎉🎉 text " * 3)
    # A boundary after token k lands inside a character when the first k tokens decode to a
    # partial one (U+FFFD); pick a budget that puts one there.
    inside = next(k for k in range(1, len(prompt)) if tokenizer.decode(prompt[:k]).endswith("\ufffd"))
    params = dict(max_new_tokens=8, do_sample=True, seed=3, prompt_logprobs=True)
    warm = run(make_engine(max_prefill_tokens=inside), [make_request(prompt, request_id="u", **params)])
    cold = run(cold_engine(make_engine), [make_request(prompt, request_id="u", **params)])
    assert_same(warm, cold)
    assert warm["u"].sequences[0].text == cold["u"].sequences[0].text


def test_a_request_cancelled_mid_prefill_leaves_only_complete_chunks(make_engine):
    prompt = random_prompt(60, seed=60)
    engine = make_engine(max_prefill_tokens=16)
    engine.submit([make_request(prompt, request_id="gone", max_new_tokens=4)])
    engine.step()
    engine.step()  # 32 of 60 prompt tokens are in its slot
    engine.cancel("gone")
    [cancelled] = run_until_idle(engine)
    assert cancelled.sequences[0].finish_reason == "cancelled"
    again = make_request(prompt, request_id="again", max_new_tokens=4)
    assert cached_tokens(engine, again) == 32
    warm = run(make_engine(max_prefill_tokens=16), [make_request(prompt, request_id="again", max_new_tokens=4)])
    assert_same(warm, run(cold_engine(make_engine), [make_request(prompt, request_id="again", max_new_tokens=4)]))


def test_a_failed_step_forgets_every_cached_prefix(make_engine):
    engine = make_engine()
    run(engine, [make_request(CONTEXT, max_new_tokens=2)])
    real_run = engine.core.runner._run
    engine.core.runner._run = lambda *args: (_ for _ in ()).throw(RuntimeError("device lost"))
    engine.submit([make_request(CONTEXT + [1], request_id="fails", max_new_tokens=2)])
    assert [f.request_id for f in engine.step().failed] == ["fails"]
    engine.core.runner._run = real_run
    assert cached_tokens(engine, make_request(CONTEXT, max_new_tokens=2)) == 0


def test_a_failed_requests_blocks_are_not_found_again(make_engine, monkeypatch):
    """Its prompt's blocks were registered as they were prefilled; its row then failed (logits
    not finite): what it computed is forgotten, its neighbour's stays cached."""
    monkeypatch.setenv(faults.INJECT_ENV, "seed=424242,after=0")
    engine = make_engine()
    hostile = random_prompt(40, seed=41)
    engine.submit([make_request(hostile, "hostile", max_new_tokens=4, do_sample=True, seed=424242),
                   make_request(CONTEXT, "neighbour", max_new_tokens=4)])
    failed = []
    while engine.has_work():
        failed += [f.request_id for f in engine.step().failed]
    assert failed == ["hostile"]
    assert cached_tokens(engine, make_request(hostile, max_new_tokens=2)) == 0
    assert cached_tokens(engine, make_request(CONTEXT, max_new_tokens=2)) == 32


# --- static decode padding (the path CUDA graphs replay, run eagerly here) --------------------------
def test_padded_decode_rows_never_overwrite_a_cached_prefix(make_engine, hf_model):
    """A finished prompt's blocks stay cached, held by no row; three streams then decode on
    three slots padded to four; the cached prefix must survive. (A pool under the default size,
    so that no stream's home lies on the cached blocks: model/kv_cache.py.)"""
    engine = make_engine(max_slots=4, static_decode=True, kv_cache_sequences=3)
    run(engine, [make_request(CONTEXT, request_id="cached", max_new_tokens=2)])
    cached = sorted(engine.cache.pool.key_of)
    streams = [make_request(random_prompt(6, seed=s), request_id=f"s{s}", max_new_tokens=12) for s in range(3)]
    engine.submit(streams)
    engine.step()
    assert len(cached) == 2 and not engine.cache.refs[cached].any() and engine.cache.slots_used == 3
    run_until_idle(engine)
    follow_up = CONTEXT + [21, 22]
    request = make_request(follow_up, request_id="reuses", max_new_tokens=10)
    engine.submit([request])
    assert engine.step().stats.cached_prompt_tokens == 32  # the context's full blocks
    [result] = run_until_idle(engine)
    assert result.sequences[0].token_ids == hf_generate(hf_model, follow_up, 10)
    cold = cold_engine(make_engine).generate([make_request(follow_up, request_id="reuses", max_new_tokens=10)])
    assert_same({"reuses": result}, {"reuses": cold[0]})


def test_without_the_cache_prompts_sharing_a_context_do_not_wait(make_engine):
    engine = make_engine(prefix_caching=False)
    engine.submit([make_request(CONTEXT + [i], request_id=f"c{i}", max_new_tokens=2) for i in range(3)])
    assert engine.step().stats.prefill_tokens == 3 * (len(CONTEXT) + 1)  # nothing to wait for
