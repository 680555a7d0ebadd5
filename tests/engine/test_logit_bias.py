"""logit_bias naming one token id more than once: the last value wins, as transformers'
sequence_bias and a JSON object do, on every device (an indexed assignment with repeated indices
keeps an unspecified one of the values on CUDA, so the ids must be unique before a tensor sees them)."""

from __future__ import annotations

from service.engine.types import SamplingParams
from tests.engine.conftest import hf_generate, make_request, random_prompt

NEW = 8


def test_a_repeated_id_keeps_its_last_value_and_its_first_place():
    params = SamplingParams(logit_bias=((7, 5.0), (3, 1.0), (7, -3.0)))
    assert params.logit_bias == ((7, -3.0), (3, 1.0))
    unique = ((7, 5.0), (3, 1.0))
    assert SamplingParams(logit_bias=unique).logit_bias == unique


def test_the_engine_applies_the_last_value_as_transformers_does(make_engine, hf_model):
    prompt = random_prompt(9, seed=11)
    plain = hf_generate(hf_model, prompt, NEW)
    target = plain[1]
    # Pushed down, then up: the last (+30) must win, so the token is forced; the reverse order
    # must suppress it. Both orders against transformers with the same list.
    for bias in (((target, -30.0), (target, 30.0)), ((target, 30.0), (target, -30.0))):
        want = hf_generate(hf_model, prompt, NEW, sequence_bias=[[[t], v] for t, v in bias])
        [result] = make_engine().generate([make_request(prompt, max_new_tokens=NEW, logit_bias=bias)])
        assert result.sequences[0].token_ids == want, bias
        assert (target in want) == (bias[-1][1] > 0), (bias, want)
