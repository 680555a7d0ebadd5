"""Beam-search requests inside the engine, sharing batches with other requests, equal generate().

(model/beam.py's own tests, against generate() directly, are tests/engine/test_beam.py and
test_beam_api.py.)
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import drive, hf_generate, make_request, random_prompt, run_until_idle

SCORE_TOLERANCE = 1e-4


@torch.no_grad()
def hf_beam(hf_model, prompt: list[int], new: int, beams: int, returned: int, **kwargs):
    ids = torch.tensor([prompt], device=hf_model.device)  # [1, T]
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        num_beams=beams,
        num_return_sequences=returned,
        do_sample=False,
        pad_token_id=hf_model.config.eos_token_id,
        output_scores=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    return [row[len(prompt) :].tolist() for row in out.sequences], out.sequences_scores.tolist()


BEAM_CASES = [
    # prompt length, new tokens, num_beams, num_return_sequences, extra settings
    (5, 8, 2, 1, {}),
    (12, 10, 4, 2, {"length_penalty": 0.5}),
    (3, 6, 3, 3, {"early_stopping": True}),
    (8, 9, 4, 1, {"repetition_penalty": 1.4}),
]


@pytest.mark.parametrize("case", range(len(BEAM_CASES)))
def test_beam_request_in_a_busy_batch_matches_generate(make_engine, hf_model, case):
    length, new, beams, returned, extra = BEAM_CASES[case]
    prompt = random_prompt(length, seed=100 + case)
    expected, scores = hf_beam(hf_model, prompt, new, beams, returned, **extra)
    engine = make_engine(max_slots=10)
    others = [
        make_request(random_prompt(7, seed=1), max_new_tokens=20),
        make_request(random_prompt(15, seed=2), max_new_tokens=4, do_sample=True, seed=3),
    ]
    late = make_request(random_prompt(4, seed=3), max_new_tokens=6)
    beam = make_request(prompt, request_id="beam", max_new_tokens=new, num_beams=beams,
                        num_return_sequences=returned, **extra)
    engine.submit(others)
    results = {f.request_id: f for f in drive(engine, 2)}
    engine.submit([beam])
    results.update((f.request_id, f) for f in drive(engine, 2))
    engine.submit([late])
    results.update((f.request_id, f) for f in run_until_idle(engine))

    sequences = results["beam"].sequences
    assert len(sequences) == returned
    pad = hf_model.config.eos_token_id
    for ours, theirs in zip(sequences, expected):
        # generate() pads hypotheses that ended early; those tokens were never generated.
        assert ours.token_ids == theirs[: len(ours.token_ids)]
        assert all(t == pad for t in theirs[len(ours.token_ids) :])
    assert [s.score for s in sequences] == pytest.approx(scores, abs=SCORE_TOLERANCE)
    # Everyone else still got exactly their own output.
    assert results[others[0].request_id].sequences[0].token_ids == hf_generate(hf_model, others[0].prompt_ids, 20)
    assert results[late.request_id].sequences[0].token_ids == hf_generate(hf_model, late.prompt_ids, 6)
    assert engine.cache.slots_used == 0


def test_beam_request_can_be_cancelled_and_frees_every_beam_slot(make_engine):
    engine = make_engine(max_slots=4)
    engine.submit([make_request([1, 2, 3], request_id="b", max_new_tokens=30, num_beams=4)])
    drive(engine, 3)
    assert engine.cache.slots_used == 4
    engine.cancel("b")
    [finished] = engine.step().finished
    assert finished.sequences[0].finish_reason == "cancelled"
    assert engine.cache.slots_used == 0
