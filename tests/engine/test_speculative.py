"""Speculative decoding from n-gram drafts gives the tokens decoding without it gives.

Every test runs the same requests with speculation on and off: greedy and seeded tokens are
identical, log-probabilities equal within 1e-5 (float32), and the step stats show drafts were
verified and accepted (so a test cannot pass by never speculating). The tiny random model's
greedy output soon cycles, which n-gram drafts predict well: acceptance is high here.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

import service.engine.layout as layout_module
from service.engine.draft_policy import LOOK_AGAIN_STEPS, DraftAcceptance, acceptance_threshold, draft_length
from service.engine.ngram_drafter import NgramIndex, NgramSettings, continuation
from service.engine.speculation import kept_length, speculates
from service.engine.types import SamplingParams
from tests.engine.conftest import make_request, random_prompt

TOLERANCE = 1e-5
# Every sequence drafts k tokens whenever it can: the most verification to get right. Pricing
# drafts by acceptance and batch size (draft_policy.py) has tests of its own at the end.
SETTINGS = NgramSettings(min_n=1, max_n=3, tokens=4, weight_pass_rows=math.inf)
# A prompt that repeats itself, so drafts exist from the first decode step.
REPEATING = random_prompt(7, seed=70) * 3


def run(make_engine, requests_fn, speculative: bool, cancel_after: dict | None = None, settings=SETTINGS, **config):
    engine = make_engine(speculative=settings if speculative else None, **config)
    totals = {"draft": 0, "accepted": 0, "steps": 0}
    results, step = {}, 0
    for batch in requests_fn():
        engine.submit(batch)
    while engine.has_work():
        output = engine.step()
        step += 1
        totals["draft"] += output.stats.draft_tokens
        totals["accepted"] += output.stats.accepted_tokens
        totals["steps"] += 1
        results.update((f.request_id, f) for f in output.finished)
        for request_id, at in (cancel_after or {}).items():
            if step == at:
                engine.cancel(request_id)
    assert engine.cache.slots_used == 0
    return results, totals


def assert_identical(ours: dict, reference: dict) -> None:
    assert ours.keys() == reference.keys()
    for request_id, result in ours.items():
        for seq, ref in zip(result.sequences, reference[request_id].sequences, strict=True):
            assert seq.token_ids == ref.token_ids, request_id
            assert seq.text == ref.text and seq.finish_reason == ref.finish_reason, request_id
            torch.testing.assert_close(seq.logprobs, ref.logprobs, rtol=0, atol=TOLERANCE)
            if ref.top_logprobs:
                assert [[t for t, _ in top] for top in seq.top_logprobs] == [[t for t, _ in top] for top in ref.top_logprobs]


def both(make_engine, requests_fn, settings=SETTINGS, **config):
    on, totals = run(make_engine, requests_fn, True, settings=settings, **config)
    off, _ = run(make_engine, requests_fn, False, **config)
    assert_identical(on, off)
    return on, totals


# --- the drafter on crafted sequences -------------------------------------------------------------
def test_drafts_follow_the_latest_earlier_occurrence_longest_n_first():
    index = NgramIndex(NgramSettings(min_n=1, max_n=3, tokens=3))
    #           0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    # "5 6 7" occurred at 0..2, followed by 8 1 6; "6 7" more recently at 5..6, followed by 9:
    # the longest n-gram wins.
    assert index.draft(tokens, limit=10) == [8, 1, 6]
    assert index.draft(tokens + [2], limit=10) == []  # "2" never occurred before
    assert index.draft(tokens + [2, 9], limit=10) == [5, 6, 7]  # "9" at 7 → 5 6 7
    assert index.draft(tokens + [2, 9], limit=2) == [5, 6]  # limited by what may still be generated
    assert index.draft([4], limit=5) == [] and NgramIndex(SETTINGS).draft([1, 1], limit=0) == []


def test_the_index_grows_with_the_sequence_and_never_proposes_its_own_end():
    index = NgramIndex(NgramSettings(min_n=2, max_n=2, tokens=4))
    tokens = [1, 2, 3]
    assert index.draft(tokens, 4) == []
    tokens += [1, 2]
    assert index.draft(tokens, 4) == [3, 1, 2, 3]  # past the sequence's end, round the loop again
    assert len(index.latest) == 3  # (1,2) (2,3) (3,1): one entry per token per n, once


def test_the_index_holds_each_n_grams_latest_end_however_the_sequence_grew():
    """Against its definition: every n-gram (min_n..max_n) that some token follows, mapped to the
    end of its latest occurrence, whether the tokens came at once or a few at a time."""
    generator = random.Random(5)
    for _ in range(50):
        settings = NgramSettings(min_n=generator.randint(1, 3), max_n=4)
        tokens = [generator.randint(0, 5) for _ in range(generator.randint(0, 40))]
        expected = {tuple(tokens[end - n : end]): end
                    for end in range(len(tokens)) for n in range(settings.min_n, settings.max_n + 1) if n <= end}
        index, grown = NgramIndex(settings), NgramIndex(settings)
        index.draft(tokens, 1)
        for length in range(0, len(tokens) + 1, generator.randint(1, 6)):
            grown.draft(tokens[:length], 1)
        grown.draft(tokens, 1)
        assert index.latest == expected and grown.latest == expected and index.indexed == grown.indexed


def test_a_loop_is_drafted_round_and_round():
    index = NgramIndex(NgramSettings(min_n=1, max_n=3, tokens=7))
    # "8 9" last occurred 2 tokens back: the loop's period is 2, and the draft repeats it.
    assert index.draft([5, 8, 9, 8, 9], limit=7) == [8, 9, 8, 9, 8, 9, 8]
    assert NgramIndex(index.settings).draft([1, 2, 3, 4, 4], limit=3) == [4, 4, 4]  # period 1
    assert continuation([1, 2, 3], 1, 2) == [2, 3]  # within the sequence: a plain copy


def test_kept_length_stops_at_the_first_disagreement():
    assert kept_length([4, 5, 6], [4, 5]) == 3  # every draft token stood, plus the bonus
    assert kept_length([4, 9, 6], [4, 5]) == 2  # the model's 9 replaces the draft's 5
    assert kept_length([7], []) == 1


def test_history_dependent_controls_and_beams_do_not_speculate():
    assert speculates(SamplingParams(do_sample=True, top_p=0.5, logit_bias=((1, 2.0),), min_new_tokens=3))
    for params in (dict(repetition_penalty=1.2), dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
                   dict(no_repeat_ngram_size=2), dict(bad_words_ids=((5,),)), dict(num_beams=2), dict(speculate=False)):
        assert not speculates(SamplingParams(**params)), params


# --- identical output -------------------------------------------------------------------------------
def test_greedy_tokens_are_identical_and_drafts_stand(make_engine):
    prompts = [REPEATING, random_prompt(5, seed=1), random_prompt(30, seed=2)]
    requests = lambda: [[make_request(p, request_id=f"g{i}", max_new_tokens=40, top_logprobs=2) for i, p in enumerate(prompts)]]  # noqa: E731
    _, totals = both(make_engine, requests)
    assert totals["accepted"] > 20 and totals["draft"] >= totals["accepted"]


# The tiny random model's next-token distribution is nearly flat: samples from it never repeat an
# n-gram. A bias on the prompt's seven tokens, strongest on the first, makes samples that mostly
# follow one of them and sometimes another: drafts that often stand and often do not.
PEAKED = tuple((token, 12.0 - 1.5 * rank) for rank, token in enumerate(REPEATING[:7]))


@pytest.mark.parametrize("seed", range(12))
def test_seeded_samples_are_identical(make_engine, seed):
    params = dict(do_sample=True, seed=seed, max_new_tokens=30, logit_bias=PEAKED)
    requests = lambda: [[  # noqa: E731
        make_request(REPEATING, request_id="a", num_return_sequences=2, temperature=0.7, top_k=50, top_p=0.9, **params),
        make_request(random_prompt(9, seed=seed), request_id="b", min_p=0.05, typical_p=0.9, **params),
    ]]
    _, totals = both(make_engine, requests)
    assert 0 < totals["accepted"] < totals["draft"]


@pytest.mark.parametrize(
    "controls",
    [dict(logit_bias=((13, 3.0),)), dict(min_new_tokens=12, stop_token_ids=(13,)), dict(stop=("ab",)),
     dict(repetition_penalty=1.3), dict(presence_penalty=0.4, frequency_penalty=0.2), dict(no_repeat_ngram_size=3),
     dict(bad_words_ids=((13,), (5, 6)))],
    ids=["bias", "min-new", "stop-string", "repetition", "presence", "no-repeat", "bad-words"],
)
def test_each_decoding_control_gives_the_same_tokens(make_engine, controls):
    requests = lambda: [[  # noqa: E731
        make_request(REPEATING, request_id="greedy", max_new_tokens=25, **controls),
        make_request(REPEATING, request_id="sampled", max_new_tokens=25, do_sample=True, seed=4, temperature=0.3, **controls),
        make_request(REPEATING, request_id="plain", max_new_tokens=25),  # speculates beside them
    ]]
    both(make_engine, requests)


@pytest.mark.parametrize("new_tokens", [1, 2, 3, 5])
def test_max_new_tokens_is_never_overshot(make_engine, new_tokens):
    requests = lambda: [[make_request(REPEATING, request_id="n", max_new_tokens=new_tokens)]]  # noqa: E731
    on, _ = both(make_engine, requests)
    assert len(on["n"].sequences[0].token_ids) == new_tokens


def test_eos_inside_an_accepted_draft_ends_the_sequence_there(make_engine, tokenizer):
    eos = tokenizer.eos_token_id
    prompt = random_prompt(4, seed=3) + [eos] + random_prompt(4, seed=3)  # the draft after it holds EOS
    requests = lambda: [[make_request(prompt, request_id="e", max_new_tokens=30, logit_bias=((eos, 8.0),))]]  # noqa: E731
    on, _ = both(make_engine, requests)
    assert on["e"].sequences[0].finish_reason == "eos_token"


def test_staggered_arrivals_with_and_without_speculation_in_one_batch(make_engine):
    def requests():
        return [
            [make_request(REPEATING, request_id="spec-0", max_new_tokens=30)],
            [make_request(random_prompt(6, seed=6), request_id="pen", max_new_tokens=20, repetition_penalty=1.2),
             make_request(random_prompt(3, seed=9), request_id="off", max_new_tokens=20, speculate=False)],
            [make_request(REPEATING[:10], request_id="spec-1", max_new_tokens=12, num_beams=2)],
        ]
    both(make_engine, requests, max_slots=6)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_verifying_drafts_is_laid_out_as_a_batch(make_engine, monkeypatch, overlap):
    """The drafted sequences' 1 + k rows follow the batch's other rows (StepLayout._batch), which
    are laid out as in a step without drafts: every output, the drafters' (greedy with
    alternatives, seeded) and their neighbours', is the one without speculation."""
    drafted_steps = []
    real = layout_module.StepLayout._batch_drafted

    def counting(self, plan, drafted, *rest):
        drafted_steps.append(len(drafted))
        return real(self, plan, drafted, *rest)

    monkeypatch.setattr(layout_module, "BATCHED_ROWS", 1)
    monkeypatch.setattr(layout_module.StepLayout, "_batch_drafted", counting)
    requests = lambda: [[  # noqa: E731
        make_request(REPEATING, request_id="greedy", max_new_tokens=30, top_logprobs=2),
        make_request(REPEATING, request_id="seeded", max_new_tokens=30, do_sample=True, seed=3, num_return_sequences=2,
                     logit_bias=PEAKED),
        make_request(random_prompt(9, seed=4), request_id="plain", max_new_tokens=30, speculate=False),
        make_request(random_prompt(5, seed=5), request_id="sampled", max_new_tokens=20, do_sample=True, seed=5),
    ]]
    _, totals = both(make_engine, requests, max_slots=6, overlap=overlap)
    assert len(drafted_steps) > 5 and totals["accepted"] > 10


def test_an_always_wrong_draft_still_gives_the_right_tokens(make_engine, monkeypatch):
    real = NgramIndex.draft
    monkeypatch.setattr(NgramIndex, "draft", lambda self, tokens, limit: [(t + 1) % 50257 for t in real(self, tokens, limit)] or [7] * min(limit, 3))
    requests = lambda: [[make_request(REPEATING, request_id="w", max_new_tokens=30, do_sample=True, seed=2, temperature=0.5)]]  # noqa: E731
    on, totals = run(make_engine, requests, True)
    monkeypatch.setattr(NgramIndex, "draft", real)
    off, _ = run(make_engine, requests, False)
    assert_identical(on, off)
    assert totals["draft"] > 0 and totals["accepted"] < totals["draft"] // 4


def test_a_cancelled_speculating_request_frees_its_slot_with_a_prefix_of_its_output(make_engine):
    requests = lambda: [[make_request(REPEATING, request_id="c", max_new_tokens=60), make_request(REPEATING, request_id="keep", max_new_tokens=20)]]  # noqa: E731
    on, _ = run(make_engine, requests, True, cancel_after={"c": 4})
    off, _ = run(make_engine, requests, False)
    cancelled = on["c"].sequences[0]
    assert cancelled.finish_reason == "cancelled"
    assert cancelled.token_ids == off["c"].sequences[0].token_ids[: len(cancelled.token_ids)]
    assert_identical({"keep": on["keep"]}, {"keep": off["keep"]})


# --- how many tokens each sequence drafts: priced by its acceptance and the batch ---------------------
def test_the_threshold_rises_with_the_batch():
    assert acceptance_threshold(1, 16.0) == pytest.approx(1 / 17)
    assert acceptance_threshold(16, 16.0) == pytest.approx(0.5)
    assert acceptance_threshold(16, math.inf) == 0.0


def test_a_draft_is_as_long_as_its_acceptance_pays_for():
    assert draft_length(0.9, 0.5, most=4) == 4  # 0.9^4 = 0.66: all four pay
    assert draft_length(0.9, 0.6, most=8) == 4  # 0.9^4 = 0.656 >= 0.6 > 0.9^5 = 0.59
    assert draft_length(0.6, 0.5, most=4) == 1  # 0.6^2 = 0.36 < 0.5
    assert draft_length(0.4, 0.5, most=4) == 0
    assert draft_length(0.5, 0.5, most=4) == 1  # exactly at the threshold
    assert draft_length(1.0, 0.9, most=3) == 3 and draft_length(0.3, 0.0, most=3) == 3
    assert draft_length(0.9, 0.1, most=0) == 0


def test_acceptance_follows_recent_drafts_and_recovers_after_failures():
    acceptance = DraftAcceptance()
    assert acceptance.rate == pytest.approx(0.5)  # the prior, before any draft
    for _ in range(10):
        acceptance.record(drafted=4, accepted=4)
    assert acceptance.rate > 0.95
    acceptance.record(drafted=4, accepted=2)  # two stood, the third did not: 2 of 3 tested
    assert 0.85 < acceptance.rate < 0.95
    for _ in range(10):
        acceptance.record(drafted=2, accepted=0)  # only the first token of each draft was tested
    failing = acceptance.rate
    assert failing < 1 / 17  # too low to pay for a row even for one client on a CPU
    steps = 0
    while draft_length(acceptance.rate, 1 / 17, 4) == 0:
        acceptance.record(drafted=0, accepted=0)  # steps without a draft: back towards the prior
        steps += 1
    assert 1 < steps < 100 and acceptance.rate > failing


def test_with_overlap_a_sequence_sits_out_only_for_drafts_worth_a_step():
    """Its token in flight, a sequence sits a step out to draft only where the draft's expected
    accepted tokens (p + p^2 + ...) make up for the step, or no other row runs in it, and its last
    look found a draft; otherwise it decodes, and looks again after LOOK_AGAIN_STEPS, where a
    draft pays its rows at all."""
    acceptance = DraftAcceptance()  # p = 0.5: at most 0.5 + 0.25 + 0.125 + 0.0625 < 1
    assert not acceptance.wants_to_look(0.05, most=4, alone=False, length=1)
    assert acceptance.wants_to_look(0.05, most=4, alone=True, length=1)  # the step it sits out is empty
    assert acceptance.wants_to_look(0.0, most=4, alone=False, length=1)  # always draft k: whenever it can
    acceptance.rate = 0.6  # 0.6 + 0.36 + 0.216 >= 1 from three tokens
    assert acceptance.wants_to_look(0.2, most=4, alone=False, length=1)
    assert not acceptance.wants_to_look(0.5, most=4, alone=False, length=1)
    acceptance.looked(found=False, length=20)  # no n-gram match last time, at 20 tokens
    assert not acceptance.wants_to_look(0.2, most=4, alone=False, length=21)
    assert not acceptance.wants_to_look(0.2, most=4, alone=True, length=20 + LOOK_AGAIN_STEPS)
    assert acceptance.wants_to_look(0.5, most=4, alone=False, length=21 + LOOK_AGAIN_STEPS)  # looks again: one token pays
    assert not acceptance.wants_to_look(0.7, most=4, alone=True, length=21 + LOOK_AGAIN_STEPS)  # no draft pays its row
    acceptance.looked(found=True, length=40)
    assert acceptance.looked_at == 40 and acceptance.wants_to_look(0.2, most=4, alone=False, length=41)


def test_failing_drafts_stop_and_greedy_tokens_stay_identical(make_engine, monkeypatch):
    """Drafts that never stand: pricing them cuts the rows verified, the tokens do not change."""
    monkeypatch.setattr(NgramIndex, "draft", lambda self, tokens, limit: [7] * limit)
    requests = lambda: [[make_request(random_prompt(9, seed=5), request_id="x", max_new_tokens=40)]]  # noqa: E731
    priced = replace(SETTINGS, weight_pass_rows=16.0)
    on, priced_totals = run(make_engine, requests, True, settings=priced)
    _, always_totals = run(make_engine, requests, True)
    off, _ = run(make_engine, requests, False)
    assert_identical(on, off)
    assert always_totals["draft"] >= 4 * 30  # k tokens at (nearly) every step
    assert 0 < priced_totals["draft"] < always_totals["draft"] / 4  # it keeps trying, a token now and then


def test_a_large_batch_drafts_only_what_stands_often(make_engine):
    """Drafts that stand about half the time: one client drafts, sixteen rows do not (at 16
    rows per weight pass a draft token must stand 50% of the time just to pay for its row)."""
    params = dict(do_sample=True, max_new_tokens=30, logit_bias=PEAKED, temperature=0.7, top_k=50, top_p=0.9)
    one = lambda: [[make_request(REPEATING, request_id="a", seed=1, **params)]]  # noqa: E731
    many = lambda: [[make_request(REPEATING, request_id=f"m{i}", seed=i, **params) for i in range(16)]]  # noqa: E731
    priced = replace(SETTINGS, weight_pass_rows=16.0)
    _, alone = both(make_engine, one, settings=priced)
    _, batched = both(make_engine, many, settings=priced, max_slots=16)
    _, always = run(make_engine, many, True, max_slots=16)
    assert alone["draft"] > 0
    assert batched["draft"] / 16 < alone["draft"] / 2  # per sequence, far fewer than alone
    assert batched["draft"] < always["draft"] / 4
