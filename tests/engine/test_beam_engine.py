"""Beam search through the engine: requests sharing batches still get generate()'s beams.

The engine runs beam requests (one KV-cache slot per beam) in the same forwards as greedy and
sampled requests, with prompts of other lengths, arriving and leaving mid-stream. Every beam
request must come out as transformers' generate(num_beams=...) on the same weights.
"""

from __future__ import annotations

import pytest

from model.beam import BeamParams
from service.inprocess import Engine, EngineConfig
from tests.engine.conftest import hf_generate, make_request, random_prompt, run_until_idle
from tests.engine.test_beam import EOS, SCORE_TOL, models, reference_beam  # noqa: F401 (fixture)

# (prompt length, settings): EOS-finished and length-finished hypotheses, every early_stopping
# mode, length penalties of both signs, a repetition penalty, and ignore_eos.
BEAM_CASES = [
    (3, dict(num_beams=3, num_return_sequences=2, max_new_tokens=8)),
    (6, dict(num_beams=4, num_return_sequences=4, max_new_tokens=6, early_stopping=True,
             length_penalty=2.0)),
    (1, dict(num_beams=2, num_return_sequences=1, max_new_tokens=10, early_stopping="never",
             length_penalty=0.5, repetition_penalty=1.3)),
    (9, dict(num_beams=3, num_return_sequences=3, max_new_tokens=5, length_penalty=-1.0,
             ignore_eos=True)),
]


def beam_prompt(case: int) -> list[int]:
    return random_prompt(BEAM_CASES[case][0], seed=100 + case)


def beam_eos(case: int) -> int | None:
    return None if BEAM_CASES[case][1].get("ignore_eos") else EOS


def beam_request(case: int):
    return make_request(beam_prompt(case), **BEAM_CASES[case][1])


@pytest.fixture(scope="module")
def references(models):
    """generate()'s (tokens, score) pairs for each case."""
    _, reference = models
    found = {}
    for case, (_, settings) in enumerate(BEAM_CASES):
        fields = {k: v for k, v in settings.items() if k != "ignore_eos"}
        params = BeamParams(eos_token_id=beam_eos(case), **fields)
        found[case] = reference_beam(reference, beam_prompt(case), params)
    return found


@pytest.fixture
def engine(models, tokenizer):
    ours, _ = models
    assert tokenizer.eos_token_id == EOS
    return Engine(ours, tokenizer, EngineConfig(max_slots=10))


def assert_matches(result, case: int, references) -> None:
    expected = references[case]
    assert [s.token_ids for s in result.sequences] == [tokens for tokens, _ in expected], case
    for sequence, (tokens, score) in zip(result.sequences, expected):
        assert sequence.score == pytest.approx(score, **SCORE_TOL), case
        ended_on_eos = tokens[-1] == beam_eos(case)
        assert sequence.finish_reason == ("eos_token" if ended_on_eos else "length"), case


def test_the_cases_finish_on_eos_and_on_length(references):
    """Otherwise the engine tests below would not see hypotheses that end early."""
    finished_on_eos = [tokens[-1] == EOS for case in (0, 1, 2) for tokens, _ in references[case]]
    assert any(finished_on_eos) and not all(finished_on_eos)


def test_beam_requests_sharing_a_batch_match_generate(engine, models, references):
    _, reference = models
    greedy_prompt = random_prompt(5, seed=7)
    requests = [beam_request(0), beam_request(1), make_request(greedy_prompt, max_new_tokens=12),
                beam_request(2)]
    results = engine.generate(requests)
    for case, result in zip((0, 1, 2), [results[0], results[1], results[3]]):
        assert_matches(result, case, references)
    assert results[2].sequences[0].token_ids == hf_generate(reference, greedy_prompt, 12)
    assert engine.cache.slots_used == 0


def test_beam_requests_joining_and_leaving_mid_stream_match_generate(engine, references):
    sampled = make_request(random_prompt(4, seed=8), max_new_tokens=9, do_sample=True, seed=3,
                           num_return_sequences=2)
    short = make_request(random_prompt(2, seed=9), max_new_tokens=2)
    # Staggered arrivals while others decode; short requests leave holes the scheduler packs.
    schedule = {0: [2, short], 2: [3, sampled], 4: [0]}
    case_of: dict[str, int] = {}
    results = {}
    moves = []
    original_move = engine.core.cache.move_row  # a packing move moves the rows' block tables
    engine.core.cache.move_row = lambda src, dst: (moves.append((src, dst)), original_move(src, dst))
    for step in range(6):
        for item in schedule.get(step, []):
            request = beam_request(item) if isinstance(item, int) else item
            if isinstance(item, int):
                case_of[request.request_id] = item
            engine.submit([request])
        results.update((f.request_id, f) for f in engine.step().finished)
    results.update((f.request_id, f) for f in run_until_idle(engine))
    for request_id, case in case_of.items():
        assert_matches(results[request_id], case, references)
    assert len(results[sampled.request_id].sequences) == 2
    assert moves, "the scenario should have packed a sequence into a lower slot"
    assert engine.cache.slots_used == 0


def test_cancelling_a_beam_request_frees_its_slots_and_spares_the_others(engine, references):
    doomed, kept = beam_request(1), beam_request(0)
    engine.submit([doomed, kept])
    engine.step()
    engine.step()
    assert engine.cache.slots_used == 4 + 3
    engine.cancel(doomed.request_id)
    results = {f.request_id: f for f in run_until_idle(engine)}
    assert {s.finish_reason for s in results[doomed.request_id].sequences} == {"cancelled"}
    assert_matches(results[kept.request_id], 0, references)
    assert engine.cache.slots_used == 0
