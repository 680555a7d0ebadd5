"""model/sampling.py against transformers' logits processors and against direct probability sums.

Statistical tests: each draws N tokens from fixed logits and runs a chi-square goodness-of-fit
test against the distribution computed directly; a correct sampler fails one with probability
P_FAIL (1e-6). Tokens the distribution excludes must never be drawn at all.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from model.sampling import (
    SamplingTensors,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k_top_p,
    choose_tokens,
    sample_rows,
    seeded_uniform,
    token_logprobs,
)

P_FAIL = 1e-6
DRAWS = 20_000


def sampling_tensors(rows: int, vocab: int, temperature=1.0, top_k=0, top_p=1.0, penalty=1.0, do_sample=True, seed=1000):
    def column(value, dtype=torch.float32):
        values = value if isinstance(value, list) else [value] * rows
        return torch.tensor(values, dtype=dtype)

    top_ks = [k if k > 0 else vocab for k in (top_k if isinstance(top_k, list) else [top_k] * rows)]
    samples = do_sample if isinstance(do_sample, list) else [do_sample] * rows
    return SamplingTensors(
        temperature=column(temperature),
        top_k=torch.tensor(top_ks),
        top_p=column(top_p),
        repetition_penalty=column(penalty),
        do_sample=torch.tensor(samples),
        seed=column(seed, torch.long),
        any_sample=any(samples),
        any_top_k_top_p=True,
        any_penalty=penalty != 1.0,
    )


def draw(logits: torch.Tensor, params_kwargs: dict, seen: torch.Tensor | None = None) -> torch.Tensor:
    """DRAWS tokens from one row of logits [V]: the successive draws of one seeded sequence."""
    vocab = logits.shape[-1]
    batch = logits.expand(DRAWS, vocab)  # [N, V]
    params = sampling_tensors(DRAWS, vocab, **params_kwargs)
    seen_rows = seen.expand(DRAWS, vocab) if seen is not None else None
    tokens, _ = choose_tokens(batch, params, torch.arange(DRAWS), seen_rows)
    return torch.bincount(tokens, minlength=vocab)


def assert_fits(counts: torch.Tensor, expected_probs: torch.Tensor) -> None:
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"drew excluded tokens: {counts[~support]}"
    expected = expected_probs[support].double() * counts.sum()
    observed = counts[support].double()
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2)
    assert p_value > P_FAIL, f"chi-square {statistic:.1f} on {dof} dof: p={p_value:.2e}"


FIXED_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.4, -1.0, -2.0, -3.0])


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens until their mass reaches top_p (the definition, directly)."""
    kept = torch.zeros_like(probs)
    mass = 0.0
    for index in probs.argsort(descending=True).tolist():
        if mass >= top_p:
            break
        kept[index] = probs[index]
        mass += float(probs[index])
    return kept / kept.sum()


def top_k_probs(logits: torch.Tensor, k: int) -> torch.Tensor:
    kept = torch.full_like(logits, float("-inf"))
    index = logits.argsort(descending=True)[:k]
    kept[index] = logits[index]
    return kept.softmax(-1)


def test_plain_sampling_follows_softmax():
    assert_fits(draw(FIXED_LOGITS, {}), FIXED_LOGITS.softmax(-1))


def test_temperature_sharpens_and_flattens():
    for temperature in (0.5, 2.0):
        counts = draw(FIXED_LOGITS, {"temperature": temperature})
        assert_fits(counts, (FIXED_LOGITS / temperature).softmax(-1))


def test_top_k_draws_only_the_k_best_with_renormalised_frequencies():
    assert_fits(draw(FIXED_LOGITS, {"top_k": 3}), top_k_probs(FIXED_LOGITS, 3))


def test_top_p_draws_only_the_nucleus_with_renormalised_frequencies():
    probs = FIXED_LOGITS.softmax(-1)
    for top_p in (0.5, 0.8, 0.95):
        assert_fits(draw(FIXED_LOGITS, {"top_p": top_p}), nucleus(probs, top_p))


def test_top_k_then_top_p_then_temperature_combined():
    # transformers' order: temperature, top-k, then top-p on what top-k left.
    scaled = FIXED_LOGITS / 0.7
    expected = nucleus(top_k_probs(scaled, 5), 0.75)
    assert_fits(draw(FIXED_LOGITS, {"temperature": 0.7, "top_k": 5, "top_p": 0.75}), expected)


def test_repetition_penalty_applies_before_sampling():
    seen = torch.zeros(FIXED_LOGITS.shape[0], dtype=torch.bool)
    seen[[0, 7]] = True  # one positive, one negative logit
    penalised = FIXED_LOGITS.clone()
    penalised[0] /= 1.5
    penalised[7] *= 1.5
    counts = draw(FIXED_LOGITS, {"penalty": 1.5}, seen=seen)
    assert_fits(counts, penalised.softmax(-1))


def test_repetition_penalty_matches_transformers_per_row():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=generator)  # [B, V]
    history = torch.randint(0, 50, (4, 12), generator=generator)  # [B, T], with repeats
    penalties = [1.0, 1.3, 0.8, 2.0]
    seen = torch.zeros(4, 50, dtype=torch.bool)
    seen.scatter_(1, history, True)
    ours = apply_repetition_penalty(logits, seen, torch.tensor(penalties))
    for row, penalty in enumerate(penalties):
        reference = RepetitionPenaltyLogitsProcessor(penalty)(history[row : row + 1], logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row], reference[0], rtol=0, atol=0)


def test_top_k_top_p_masks_match_transformers_per_row():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 200, generator=generator) * 3  # [B, V]
    logits[5, :10] = logits[5, 0]  # ties at the cut-off
    settings = [(0, 1.0), (1, 1.0), (7, 1.0), (0, 0.3), (20, 0.9), (5, 0.99)]
    top_k = torch.tensor([k if k else 200 for k, _ in settings])
    top_p = torch.tensor([p for _, p in settings])
    ours = apply_top_k_top_p(logits, top_k, top_p)
    for row, (k, p) in enumerate(settings):
        reference = logits[row : row + 1].clone()
        if k:
            reference = TopKLogitsWarper(k)(None, reference)
        if p < 1.0:
            reference = TopPLogitsWarper(p)(None, reference)
        torch.testing.assert_close(ours[row], reference[0], rtol=0, atol=0)


def test_temperature_matches_transformers():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(2))
    params = sampling_tensors(1, 30, temperature=0.6)
    reference = TemperatureLogitsWarper(0.6)(None, logits.clone())
    torch.testing.assert_close(apply_temperature(logits, params.temperature), reference)


def test_greedy_rows_take_the_argmax_even_beside_sampled_rows():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    do_sample = [False, True, False, True, True, False]
    params = sampling_tensors(6, 40, temperature=3.0, do_sample=do_sample)
    tokens, _ = choose_tokens(logits, params, torch.zeros(6, dtype=torch.long))
    for row, sampled in enumerate(do_sample):
        if not sampled:
            assert tokens[row] == logits[row].argmax()


def test_a_rows_draws_depend_only_on_its_own_seed_and_counter():
    generator = torch.Generator().manual_seed(4)
    probs = torch.rand(5, 100, generator=generator).softmax(-1)  # [B, V]
    alone = sample_rows(probs[2:3], seeded_uniform(torch.tensor([77]), torch.tensor([9])))
    crowd = seeded_uniform(torch.tensor([1, 2, 77, 3, 4]), torch.tensor([0, 3, 9, 100, 2]))
    mixed = sample_rows(probs, crowd)
    assert mixed[2] == alone[0]
    # And the draw really depends on the seed (else the test above proves nothing).
    others = {int(sample_rows(probs[2:3], seeded_uniform(torch.tensor([s]), torch.tensor([9])))[0]) for s in range(20)}
    assert len(others) > 1


def test_zero_probability_tokens_are_never_drawn_even_at_the_ends_of_the_unit_interval():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(3, 5)  # [B, V]
    ends = torch.tensor([0.0, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    assert sample_rows(probs, ends).tolist() == [1, 3, 3]


def test_token_logprobs_equal_log_softmax():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(5)) * 4
    tokens = torch.tensor([0, 17, 499])
    expected = logits.log_softmax(-1)[torch.arange(3), tokens]
    torch.testing.assert_close(token_logprobs(logits, tokens), expected, rtol=0, atol=1e-5)


def test_logprob_is_of_the_raw_distribution_not_the_filtered_one():
    logits = FIXED_LOGITS[None]  # [1, V]
    params = sampling_tensors(1, 10, temperature=0.5, top_k=2)
    tokens, logprobs = choose_tokens(logits, params, torch.zeros(1, dtype=torch.long))
    assert tokens[0] in (0, 1)
    expected = FIXED_LOGITS.log_softmax(-1)[tokens[0]]
    assert logprobs[0] == pytest.approx(float(expected), abs=1e-6)
