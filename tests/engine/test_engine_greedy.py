"""Greedy decoding through the engine equals transformers' generate() token for token.

Alone, mixed in one batch with prompts of other lengths, joining and leaving mid-stream, and
with a repetition penalty. Log-probabilities equal transformers' log-softmax within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import (
    drive,
    hf_generate,
    make_request,
    random_prompt,
    run_until_idle,
)

LOGPROB_TOLERANCE = 1e-4  # fp32 log-softmax of logits that agree within ~1e-5

# (prompt length, new tokens): short and long prompts, one token and many.
CASES = [(1, 12), (2, 1), (5, 20), (9, 7), (17, 16), (33, 5), (48, 24), (64, 10)]


@pytest.fixture(scope="module")
def references(hf_model):
    return {
        (length, new): hf_generate(hf_model, random_prompt(length, seed=length), new)
        for length, new in CASES
    }


def greedy_request(length: int, new: int, **params):
    return make_request(random_prompt(length, seed=length), max_new_tokens=new, **params)


def test_each_prompt_alone_matches_generate(make_engine, references):
    engine = make_engine(max_slots=2)
    for length, new in CASES:
        [result] = engine.generate([greedy_request(length, new)])
        assert result.sequences[0].token_ids == references[length, new], (length, new)
        assert result.sequences[0].finish_reason == "length"
    assert engine.cache.slots_used == 0


def count_static_runs(engine) -> list:
    """Record each static-decode run (graphs.py), so a test knows that path was taken."""
    runs = []
    real_run = engine.core.runner.static_decode.run
    engine.core.runner.static_decode.run = lambda slots, ids, positions, *rest: (runs.append(len(ids)), real_run(slots, ids, positions, *rest))[1]
    return runs


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static-decode"])
def test_all_prompts_in_one_batch_match_generate(make_engine, references, static):
    engine = make_engine(max_slots=len(CASES), static_decode=static)
    runs = count_static_runs(engine) if static else None
    results = engine.generate([greedy_request(length, new) for length, new in CASES])
    for (length, new), result in zip(CASES, results):
        assert result.sequences[0].token_ids == references[length, new], (length, new)
    assert engine.cache.slots_used == 0
    if static:
        assert runs and any(rows not in engine.core.runner.static_decode.batch_sizes for rows in runs), runs


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static-decode"])
def test_joining_and_leaving_mid_stream_changes_nobody(make_engine, references, static):
    engine = make_engine(max_slots=4, static_decode=static)
    runs = count_static_runs(engine) if static else None
    moves = []
    original_move = engine.core.cache.move_row  # a packing move moves the rows' block tables
    engine.core.cache.move_row = lambda src, dst: (moves.append((src, dst)), original_move(src, dst))
    results = {}
    # Staggered arrivals; short requests finish early and leave holes below running ones.
    schedule = {0: [(48, 24), (2, 1)], 1: [(9, 7)], 3: [(5, 20), (1, 12)], 6: [(33, 5)], 9: [(17, 16), (64, 10)]}
    ids = {}
    for step in range(12):
        for length, new in schedule.get(step, []):
            request = greedy_request(length, new)
            ids[request.request_id] = (length, new)
            engine.submit([request])
        results.update((f.request_id, f) for f in drive(engine, 1))
    results.update((f.request_id, f) for f in run_until_idle(engine))
    assert set(results) == set(ids)
    for request_id, key in ids.items():
        assert results[request_id].sequences[0].token_ids == references[key], key
    assert moves, "the scenario should have packed a sequence into a lower slot"
    assert engine.cache.slots_used == 0
    if static:  # padded batches ran (3 rows on 4), beside admissions into the padded slots
        assert 3 in runs, runs


def test_logprobs_match_transformers_log_softmax(make_engine, hf_model):
    prompt = random_prompt(11, seed=11)
    [result] = make_engine().generate([make_request(prompt, max_new_tokens=6)])
    sequence = result.sequences[0]
    ids = torch.tensor([prompt + sequence.token_ids], device=hf_model.device)
    with torch.no_grad():
        logprobs = hf_model(ids).logits[0].log_softmax(-1)  # [T, V]
    expected = [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(sequence.token_ids)]
    assert sequence.logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_generate(make_engine, hf_model, penalty):
    # A prompt with repeats, so the penalty meets tokens seen several times.
    prompt = random_prompt(8, seed=3)
    expected = hf_generate(hf_model, prompt, 25, repetition_penalty=penalty)
    plain = hf_generate(hf_model, prompt, 25)
    assert expected != plain, "the penalty must change the output for this test to mean anything"
    engine = make_engine(max_slots=3)
    # Mixed with unpenalised requests in the same batch.
    results = engine.generate(
        [
            make_request(prompt, max_new_tokens=25, repetition_penalty=penalty),
            make_request(prompt, max_new_tokens=25),
            make_request(random_prompt(9, seed=9), max_new_tokens=7, repetition_penalty=1.1),
        ]
    )
    assert results[0].sequences[0].token_ids == expected
    assert results[1].sequences[0].token_ids == plain
    assert results[2].sequences[0].token_ids == hf_generate(
        hf_model, random_prompt(9, seed=9), 7, repetition_penalty=1.1
    )


def test_prompt_logprobs_match_transformers(make_engine, hf_model):
    prompt = random_prompt(20, seed=20)
    other = random_prompt(7, seed=7)
    results = make_engine().generate(
        [make_request(prompt, max_new_tokens=2, prompt_logprobs=True), make_request(other, max_new_tokens=2)]
    )
    with torch.no_grad():
        logprobs = hf_model(torch.tensor([prompt], device=hf_model.device)).logits[0].log_softmax(-1)  # [T, V]
    expected = [logprobs[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert results[0].prompt_logprobs[0] is None
    assert results[0].prompt_logprobs[1:] == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
    assert results[1].prompt_logprobs is None
