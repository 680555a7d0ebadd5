"""model/beam.py against transformers' generate(num_beams=...) on a tiny checkpoint.

Our model runs through the KV cache (one slot per beam, reordered with copy_slots) via
`beam_generate`; transformers runs its own GPT2LMHeadModel on the same weights. Sequences must be
token-identical and sequences_scores equal within abs 1e-4 (rel 1e-6 for the large scores that
length_penalty=-1 gives).
"""

from __future__ import annotations

import functools
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from model.beam import BeamParams, beam_generate
from tests.conftest import TINY, perturbed_state
from tests.model.hf_reference import load_reference
from weights.checkpoint import load_model
from weights.random_init import write_model_dir

EOS = 50256
SCORE_TOL = {"abs": 1e-4, "rel": 1e-6}
# 16 tokens: every beam soon holds a different mix of tokens, so repetition_penalty (which sees
# each beam's own tokens) changes the ranking at most steps; the last token is the EOS.
SMALL_VOCAB = TINY.with_(vocab_size=16, bos_token_id=15, eos_token_id=15)


def beam_test_state() -> dict[str, torch.Tensor]:
    """The tiny model, made to choose: sharper next-token distributions and a likely EOS.

    A random 64-wide model spreads its probability almost evenly over 50257 tokens, where beams
    barely compete and float noise could decide ties. Scaling ln_f sharpens the logits (a gain
    of 8 leaves a clear winner ~2 nats ahead at each step, with runners-up close to each other),
    and pushing ln_f's bias along EOS's embedding makes EOS a frequent runner-up (log-prob about
    -4), so hypotheses really finish early and compete with the running beams.
    """
    state = perturbed_state(TINY, seed=0)
    gain = 8.0
    eos_direction = state["wte.weight"][EOS] / state["wte.weight"][EOS].norm()  # [C]
    state["ln_f.weight"] *= gain
    state["ln_f.bias"] = state["ln_f.bias"] * gain + 45.0 * eos_direction
    return state


def small_vocab_state() -> dict[str, torch.Tensor]:
    state = perturbed_state(SMALL_VOCAB, seed=0)
    state["ln_f.weight"] *= 3.0  # a few likely tokens rather than 16 nearly equal ones
    state["ln_f.bias"] *= 3.0
    return state


def load_pair(model_dir: Path, config):
    """Our model and transformers' GPT2LMHeadModel, both reading `model_dir`."""
    return load_model(model_dir), load_reference(model_dir, config)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    model_dir = tmp_path_factory.mktemp("beam-gpt2")
    write_model_dir(model_dir, TINY, beam_test_state())
    return load_pair(model_dir, TINY)


@pytest.fixture(scope="module")
def small_vocab_models(tmp_path_factory: pytest.TempPathFactory):
    model_dir = tmp_path_factory.mktemp("beam-gpt2-16")
    write_model_dir(model_dir, SMALL_VOCAB, small_vocab_state())
    return load_pair(model_dir, SMALL_VOCAB)


@pytest.fixture(scope="module")
def favourite_token(models) -> int:
    """The token this model produces most: as eos_token_id it makes EOS the usual top choice."""
    _, reference = models
    prompt = torch.tensor([[464, 2068, 7586]])
    with torch.no_grad():
        greedy = reference.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
            num_beams=1, pad_token_id=EOS,
        )[0, 3:]
    return int(greedy.mode().values)


@torch.no_grad()
def run_generate(reference, prompt: list[int], params: BeamParams):
    """transformers' generate() with these beam settings, as a GenerateBeamDecoderOnlyOutput."""
    # generate() fills unset fields from the model's generation config, which names EOS 50256;
    # setting it there is the only way to ask for "no EOS" (eos_token_id=None).
    configured_eos = reference.generation_config.eos_token_id
    reference.generation_config.eos_token_id = params.eos_token_id
    ids = torch.tensor([prompt])  # [1, T]
    try:
        return reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            num_beams=params.num_beams,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            num_return_sequences=params.num_return_sequences,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=params.eos_token_id,
            pad_token_id=EOS,
            repetition_penalty=params.repetition_penalty,
            return_dict_in_generate=True,
            output_scores=True,
        )
    finally:
        reference.generation_config.eos_token_id = configured_eos


def reference_beam(reference, prompt: list[int], params: BeamParams) -> list[tuple[list[int], float]]:
    """generate()'s (generated tokens, sequences_score) pairs, padding removed."""
    out = run_generate(reference, prompt, params)
    # Shorter sequences are padded to the longest; beam_indices is -1 past each one's real end.
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    start = len(prompt)
    return [
        (out.sequences[i, start : start + n].tolist(), float(out.sequences_scores[i]))
        for i, n in enumerate(lengths)
    ]


def assert_same_as_generate(models, prompt: list[int], params: BeamParams):
    ours_model, reference = models
    expected = reference_beam(reference, prompt, params)
    ours = beam_generate(ours_model, prompt, params)
    assert [h.token_ids for h in ours] == [tokens for tokens, _ in expected], params
    for hypothesis, (_, score) in zip(ours, expected):
        assert hypothesis.score == pytest.approx(score, **SCORE_TOL), params
    return ours, expected


# --- a grid of settings -------------------------------------------------------------------------


def grid_case(index: int) -> tuple[list[int], dict]:
    """Settings for case `index`, spread over every value the brief names, reproducibly."""
    rng = random.Random(index)
    num_beams = [2, 3, 4, 5][index % 4]
    prompt = [rng.randrange(TINY.vocab_size) for _ in range(rng.randint(1, 8))]
    settings = dict(
        num_beams=num_beams,
        length_penalty=[0.5, 1.0, 2.0, -1.0][(index // 4) % 4],
        early_stopping=[False, True, "never"][index % 3],
        num_return_sequences=rng.randint(1, num_beams),
        eos=rng.choice(["eos", "eos", "favourite", "none"]),
        max_new_tokens=1 if index == 5 else rng.randint(2, 12),
        repetition_penalty=[1.0, 1.3, 1.0, 0.8][(index // 2) % 4],
    )
    return prompt, settings


GRID = [grid_case(i) for i in range(20)]


def resolve(settings: dict, favourite: int) -> BeamParams:
    eos = {"eos": EOS, "favourite": favourite, "none": None}[settings["eos"]]
    fields = {k: v for k, v in settings.items() if k != "eos"}
    return BeamParams(eos_token_id=eos, **fields)


@pytest.fixture(scope="module")
def run_grid_case(models, favourite_token):
    """Each grid case runs once; the coverage test below reads the same results."""

    @functools.cache
    def run(index: int):
        prompt, settings = GRID[index]
        return assert_same_as_generate(models, prompt, resolve(settings, favourite_token))

    return run


@pytest.mark.parametrize("index", range(len(GRID)), ids=lambda i: f"case{i}")
def test_beam_search_matches_generate(run_grid_case, index):
    run_grid_case(index)


def test_grid_finishes_hypotheses_on_eos_before_max_new_tokens(run_grid_case, favourite_token):
    """The grid is only a test of EOS handling if hypotheses really end on EOS, early."""
    early_eos = length_ended = mixed = 0
    for index, (_, settings) in enumerate(GRID):
        ours, _ = run_grid_case(index)
        limit = resolve(settings, favourite_token).max_new_tokens
        reasons = {h.finish_reason for h in ours}
        early_eos += sum(h.finish_reason == "eos_token" and len(h.token_ids) < limit for h in ours)
        length_ended += sum(h.finish_reason == "length" for h in ours)
        mixed += reasons == {"eos_token", "length"}
    assert early_eos >= 10 and length_ended >= 10 and mixed >= 2, (early_eos, length_ended, mixed)


# --- cases chosen to show each rule at work -----------------------------------------------------


@pytest.mark.parametrize(
    "prompt, num_beams, length_penalty, max_new_tokens, differing",
    [
        # Under False the heuristic stops once no running beam can beat the finished ones at the
        # current length; "never" (length_penalty > 0) assumes max_new_tokens and keeps going.
        ([47286, 14992, 38741], 2, 1.0, 4, (False, "never")),
        # True stops as soon as num_beams hypotheses are finished.
        ([1667], 2, 1.0, 9, (True, False)),
    ],
)
def test_early_stopping_modes_differ_as_in_generate(
    models, favourite_token, prompt, num_beams, length_penalty, max_new_tokens, differing
):
    params = BeamParams(
        num_beams=num_beams,
        length_penalty=length_penalty,
        num_return_sequences=num_beams,
        eos_token_id=favourite_token,
        max_new_tokens=max_new_tokens,
    )
    results = {
        mode: assert_same_as_generate(models, prompt, replace(params, early_stopping=mode))[1]
        for mode in (True, False, "never")
    }
    first, second = differing
    assert results[first] != results[second], "this case no longer tells the modes apart"


def test_repetition_penalty_sees_prompt_and_generated_tokens(models, favourite_token):
    # The favourite token in the prompt is penalised from the first step on.
    prompt = [464, favourite_token, 2068]
    params = BeamParams(num_beams=3, num_return_sequences=3, eos_token_id=EOS, max_new_tokens=8)
    plain, _ = assert_same_as_generate(models, prompt, params)
    penalised, _ = assert_same_as_generate(models, prompt, replace(params, repetition_penalty=1.5))
    assert [h.token_ids for h in plain] != [h.token_ids for h in penalised]


def test_token_logprobs_match_transition_scores(models):
    ours_model, reference = models
    prompt = [818, 257, 1499, 1201]
    params = BeamParams(
        num_beams=4, num_return_sequences=4, eos_token_id=EOS, max_new_tokens=7,
        length_penalty=0.5, repetition_penalty=1.2,
    )
    out = run_generate(reference, prompt, params)
    transition = reference.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
    ours = beam_generate(ours_model, prompt, params)
    for row, hypothesis in enumerate(ours):
        n = len(hypothesis.token_ids)
        assert hypothesis.token_logprobs == pytest.approx(transition[row, :n].tolist(), abs=1e-4)
        # The score is exactly the sum of the token log-probs over length ** length_penalty.
        expected = sum(hypothesis.token_logprobs) / n**0.5
        assert hypothesis.score == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("seed", range(8))
def test_repetition_penalty_follows_each_beam_on_a_small_vocabulary(small_vocab_models, seed):
    """Beams swap histories at every step here; each must be penalised for its own tokens."""
    rng = random.Random(seed)
    num_beams = [2, 3, 4, 5][seed % 4]
    params = BeamParams(
        num_beams=num_beams,
        num_return_sequences=num_beams,
        length_penalty=[0.5, 1.0, 2.0][seed % 3],
        early_stopping=[False, True, "never"][(seed // 2) % 3],
        eos_token_id=[SMALL_VOCAB.eos_token_id, None][seed % 2],
        max_new_tokens=rng.randint(4, 12),
        repetition_penalty=[1.5, 0.7, 2.0][(seed // 3) % 3],
    )
    prompt = [rng.randrange(SMALL_VOCAB.vocab_size) for _ in range(rng.randint(1, 6))]
    assert_same_as_generate(small_vocab_models, prompt, params)
