"""Decoding controls in the engine, batched: each request's greedy tokens equal transformers'
generate() with the same control (presence/frequency penalties: a greedy loop on transformers'
logits with vLLM's definition), alone and mixed in one batch; warpers equal transformers'
logits warpers row by row; seeded sampling unchanged by batch-mates."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TypicalLogitsWarper

from model.logits_processors import apply_min_p, apply_typical_p
from tests.engine.conftest import hf_generate, make_request, random_prompt, run_until_idle

NEW = 12
EOS = 50256


def prompt(seed: int) -> list[int]:
    return random_prompt(6 + seed, seed=seed)


def cases(hf_model) -> list[tuple[dict, dict, list[int]]]:
    """(our SamplingParams, transformers' generate() kwargs, prompt) per control."""
    base = prompt(1)
    plain = hf_generate(hf_model, base, NEW)
    repeated = base + base  # a prompt full of repeated n-grams
    return [
        ({"no_repeat_ngram_size": 2}, {"no_repeat_ngram_size": 2}, repeated),
        ({"no_repeat_ngram_size": 3}, {"no_repeat_ngram_size": 3}, prompt(2)),
        # bad words: the plain answer's 2nd token alone, and its 3rd after its 2nd
        ({"bad_words_ids": ((plain[1],), (plain[2], plain[3]))},
         {"bad_words_ids": [[plain[1]], [plain[2], plain[3]]]}, base),
        ({"logit_bias": ((plain[4], 5.0), (plain[0], -3.0))},
         {"sequence_bias": [[[plain[4]], 5.0], [[plain[0]], -3.0]]}, base),
        # EOS made likely, then held off for 5 tokens
        ({"logit_bias": ((EOS, 30.0),), "min_new_tokens": 5},
         {"sequence_bias": [[[EOS], 30.0]], "min_new_tokens": 5}, prompt(3)),
        # a stop token id ends the sequence as an EOS would
        ({"stop_token_ids": (plain[3],)}, {"eos_token_id": [EOS, plain[3]]}, base),
        ({"stop_token_ids": (plain[3],), "min_new_tokens": 6, "logit_bias": ((plain[3], 30.0),)},
         {"eos_token_id": [EOS, plain[3]], "min_new_tokens": 6, "sequence_bias": [[[plain[3]], 30.0]]}, base),
        ({"repetition_penalty": 1.5, "no_repeat_ngram_size": 2, "logit_bias": ((plain[2], 2.0),)},
         {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2, "sequence_bias": [[[plain[2]], 2.0]]}, repeated),
    ]


@torch.no_grad()
def penalised_greedy(hf_model, prompt_ids: list[int], new: int, presence: float, frequency: float) -> list[int]:
    """vLLM's presence/frequency penalties on transformers' logits: generated tokens only."""
    ids, out = list(prompt_ids), []
    counts = torch.zeros(hf_model.config.vocab_size)
    for _ in range(new):
        logits = hf_model(torch.tensor([ids], device=hf_model.device)).logits[0, -1].float().cpu()  # [V]
        logits = logits - frequency * counts - presence * (counts > 0).float()
        token = int(logits.argmax())
        counts[token] += 1
        ids.append(token)
        out.append(token)
        if token == EOS:
            break
    return out


def test_each_control_alone_and_all_in_one_batch_match_transformers(make_engine, hf_model):
    table = cases(hf_model)
    expected = [hf_generate(hf_model, ids, NEW, **hf_kwargs) for _, hf_kwargs, ids in table]
    expected.append(penalised_greedy(hf_model, prompt(4), NEW, presence=1.5, frequency=0.7))
    params = [ours for ours, _, _ in table] + [{"presence_penalty": 1.5, "frequency_penalty": 0.7}]
    prompts = [ids for _, _, ids in table] + [prompt(4)]
    # Alone: each in its own engine.
    for ours, ids, want in zip(params, prompts, expected):
        engine = make_engine()
        [result] = engine.generate([make_request(ids, max_new_tokens=NEW, **ours)])
        assert result.sequences[0].token_ids == want, ours
    # Together: one batch of all (with a plain request too), slots ≥ requests.
    engine = make_engine(max_slots=len(params) + 1)
    requests = [make_request(ids, max_new_tokens=NEW, **ours) for ours, ids in zip(params, prompts)]
    requests.append(make_request(prompt(1), max_new_tokens=NEW))
    results = engine.generate(requests)
    assert [r.sequences[0].token_ids for r in results] == expected + [hf_generate(hf_model, prompt(1), NEW)]


def test_controls_change_the_answer(make_engine, hf_model):
    """The cases are not vacuous: each control changes the plain greedy answer."""
    for ours, _, ids in cases(hf_model):
        engine = make_engine()
        [plain, controlled] = engine.generate(
            [make_request(ids, max_new_tokens=NEW), make_request(ids, max_new_tokens=NEW, **ours)]
        )
        assert plain.sequences[0].token_ids != controlled.sequences[0].token_ids, ours


def test_min_p_and_typical_p_equal_transformers_row_by_row():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=generator) * 3  # [B, V]
    min_p = torch.tensor([0.0, 0.05, 0.2, 0.5, 0.9, 1.0])
    mass = torch.tensor([1.0, 0.2, 0.5, 0.9, 0.95, 0.99])
    ours_min_p, ours_typical = apply_min_p(logits, min_p), apply_typical_p(logits, mass)
    for row in range(logits.shape[0]):
        ids = torch.zeros(1, 1, dtype=torch.long)
        want = MinPLogitsWarper(float(min_p[row]))(ids, logits[row : row + 1]) if min_p[row] > 0 else logits[row : row + 1]
        assert torch.equal(ours_min_p[row : row + 1], want)
        want = TypicalLogitsWarper(float(mass[row]))(ids, logits[row : row + 1]) if mass[row] < 1 else logits[row : row + 1]
        assert torch.equal(ours_typical[row : row + 1], want)


def test_seeded_sampling_with_warpers_is_batch_invariant(make_engine):
    params = {"do_sample": True, "seed": 7, "min_p": 0.1, "typical_p": 0.9, "temperature": 1.3,
              "presence_penalty": 0.5, "no_repeat_ngram_size": 2}
    engine = make_engine()
    [alone] = engine.generate([make_request(prompt(5), max_new_tokens=NEW, **params)])
    engine = make_engine()
    mates = [make_request(prompt(s), max_new_tokens=NEW, do_sample=True, seed=s) for s in range(3)]
    results = engine.generate(mates[:1] + [make_request(prompt(5), max_new_tokens=NEW, **params)] + mates[1:])
    assert results[1].sequences[0].token_ids == alone.sequences[0].token_ids


def test_a_reused_slot_keeps_nothing_of_its_previous_request(make_engine, hf_model):
    """Bias and bad-word tables are gathered for a whole batch: a plain request taking over the
    slot of a controlled one must decode as if that one never was."""
    want = hf_generate(hf_model, prompt(2), NEW)
    # Controls aimed at exactly the tokens the plain request will want.
    aimed = {"logit_bias": ((want[0], -50.0),), "bad_words_ids": ((want[1],),)}
    other = {"logit_bias": ((want[2], 1.0),), "bad_words_ids": ((EOS,),)}
    engine = make_engine(max_slots=2)
    engine.generate([make_request(prompt(2), max_new_tokens=NEW, **aimed)])  # alone: slot 0
    plain, _ = engine.generate([make_request(prompt(2), max_new_tokens=NEW),  # slot 0 again
                                make_request(prompt(1), max_new_tokens=NEW, **other)])
    assert plain.sequences[0].token_ids == want
    # The same after a sampled request with warpers and a penalty, beside a sampled one (the
    # batch samples and warps: the greedy row's parameters must be greedy's again).
    sampled = {"do_sample": True, "seed": 5, "temperature": 3.0, "top_k": 7, "min_p": 0.2, "repetition_penalty": 1.5}
    engine = make_engine(max_slots=2)
    engine.generate([make_request(prompt(2), max_new_tokens=NEW, **sampled)])  # alone: slot 0
    plain, _ = engine.generate([make_request(prompt(2), max_new_tokens=NEW),  # slot 0 again
                                make_request(prompt(1), max_new_tokens=NEW, **{**sampled, "typical_p": 0.5})])
    assert plain.sequences[0].token_ids == want
