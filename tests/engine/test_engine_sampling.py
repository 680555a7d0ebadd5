"""Sampled requests in the engine: per-request seeds, per-row parameters in mixed batches."""

from __future__ import annotations

import torch

from tests.engine.conftest import drive, hf_generate, make_request, random_prompt, run_until_idle

SAMPLED = dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.95)


def busy_engine_output(engine, target, extra_before, extra_after, warmup_steps=3):
    """Run `target` after `extra_before` have started, while `extra_after` join later."""
    engine.submit(extra_before)
    results = {f.request_id: f for f in drive(engine, warmup_steps)}
    engine.submit([target])
    results.update((f.request_id, f) for f in drive(engine, 2))
    engine.submit(extra_after)
    results.update((f.request_id, f) for f in run_until_idle(engine))
    return results[target.request_id]


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_busy_batch(make_engine):
    prompt = random_prompt(10, seed=1)
    [alone] = make_engine().generate([make_request(prompt, max_new_tokens=30, seed=1234, **SAMPLED)])
    crowd_before = [
        make_request(random_prompt(20, seed=2), max_new_tokens=40, seed=5, **SAMPLED),
        make_request(random_prompt(3, seed=3), max_new_tokens=4),
        make_request(random_prompt(7, seed=4), max_new_tokens=50, do_sample=True, temperature=1.5),
    ]
    crowd_after = [
        make_request(random_prompt(30, seed=5), max_new_tokens=10, repetition_penalty=1.2),
        make_request(random_prompt(5, seed=6), max_new_tokens=20, do_sample=True, num_return_sequences=3),
    ]
    target = make_request(prompt, max_new_tokens=30, seed=1234, **SAMPLED)
    busy = busy_engine_output(make_engine(max_slots=8), target, crowd_before, crowd_after)
    assert busy.sequences[0].token_ids == alone.sequences[0].token_ids
    assert busy.seed == alone.seed == 1234
    # A different seed gives different tokens (else equality above proves nothing).
    [other] = make_engine().generate([make_request(prompt, max_new_tokens=30, seed=4321, **SAMPLED)])
    assert other.sequences[0].token_ids != alone.sequences[0].token_ids


def test_unseeded_request_reports_a_seed_that_reproduces_it(make_engine):
    engine = make_engine()
    prompt = random_prompt(8, seed=8)
    [first] = engine.generate([make_request(prompt, max_new_tokens=20, do_sample=True)])
    assert first.seed is not None
    [again] = engine.generate([make_request(prompt, max_new_tokens=20, do_sample=True, seed=first.seed)])
    assert again.sequences[0].token_ids == first.sequences[0].token_ids


def test_several_return_sequences_share_one_prefill_and_differ(make_engine):
    engine = make_engine(max_slots=4)
    prompt = random_prompt(12, seed=12)
    engine.submit([make_request(prompt, max_new_tokens=15, num_return_sequences=3, seed=7, **SAMPLED)])
    first = engine.step()  # the prompt runs once, not once per sequence
    assert first.stats.prefill_tokens == len(prompt)
    assert first.stats.batch_size == 3
    [result] = run_until_idle(engine)
    sequences = [s.token_ids for s in result.sequences]
    assert len(sequences) == 3 and all(len(s) == 15 for s in sequences)
    assert len({tuple(s) for s in sequences}) == 3
    assert engine.cache.slots_used == 0
    # Sequence 0 of a seeded request is the same as the request with n=1: the copies of the
    # prompt's cache give every sequence the same starting point.
    [single] = engine.generate([make_request(prompt, max_new_tokens=15, seed=7, **SAMPLED)])
    assert single.sequences[0].token_ids == sequences[0]


def test_top_k_one_is_greedy_inside_a_mixed_batch(make_engine, hf_model):
    prompts = [random_prompt(9, seed=9), random_prompt(14, seed=14)]
    engine = make_engine()
    results = engine.generate(
        [
            make_request(prompts[0], max_new_tokens=12, do_sample=True, top_k=1, temperature=2.0),
            make_request(prompts[1], max_new_tokens=12, do_sample=True, temperature=2.0),
        ]
    )
    assert results[0].sequences[0].token_ids == hf_generate(hf_model, prompts[0], 12)


@torch.no_grad()
def test_sampled_tokens_stay_inside_each_rows_top_k(make_engine, hf_model):
    prompts = [random_prompt(6, seed=s) for s in (21, 22, 23)]
    top_ks = [2, 5, 0]
    engine = make_engine()
    results = engine.generate(
        [
            make_request(p, max_new_tokens=25, do_sample=True, temperature=3.0, top_k=k, seed=i)
            for i, (p, k) in enumerate(zip(prompts, top_ks))
        ]
    )
    for prompt, k, result in zip(prompts, top_ks, results):
        generated = result.sequences[0].token_ids
        logits = hf_model(torch.tensor([prompt + generated], device=hf_model.device)).logits[0]  # [T, V]
        step_logits = logits[len(prompt) - 1 : -1]  # [new, V]: the logits each token was drawn from
        ranks = (step_logits > step_logits.gather(1, torch.tensor(generated, device=step_logits.device)[:, None])).sum(1)
        if k:
            assert int(ranks.max()) < k, (k, ranks.tolist())
        else:
            assert int(ranks.max()) >= 5  # temperature 3 without top-k wanders far down the list
