"""The seed contract (docs/batch-invariance.md, "The seed contract"): a seeded request's draws are
fixed values, the same in every version, not merely the same on every path.

Draw n of a sequence seeded s is splitmix64's output for seed s at counter n (its state after n
steps of γ), the top 53 bits as a double in [0, 1); n is the number of tokens the sequence holds
when it draws (prompt included), and sequence i of a request seeded s uses (s + i·γ) mod 2^63.
The other sampling tests compare paths with each other, so a shift of every draw by one position
would pass them; the values recorded here change with it. Changing them breaks the contract.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import service.engine.layout as layout_module
from model.sampling import choose_tokens, seeded_uniform
from tests.engine.conftest import make_request
from tests.engine.test_sampling import FIXED_LOGITS, sampling_tensors

GAMMA = 0x9E3779B97F4A7C15


def splitmix64(seed: int, counter: int) -> int:
    """The reference generator in Python's unbounded integers, reduced modulo 2^64 by hand."""
    mask = (1 << 64) - 1
    z = (seed + counter * GAMMA) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def uniform(bits: int) -> float:
    return (bits >> 11) * 2.0**-53


def test_the_reference_gives_splitmix64s_published_outputs():
    # A generator seeded s returns draws 1, 2, ... of the counter form: state s + n·γ, mixed.
    # Seed 0: Vigna's reference implementation (splitmix64.c); seed 1234567: Rosetta Code's task.
    published = {
        0: [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F],
        1234567: [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
                  16408922859458223821],
    }
    for seed, outputs in published.items():
        assert [splitmix64(seed, n) for n in range(1, len(outputs) + 1)] == outputs, seed


def test_seeded_uniform_is_splitmix64_in_wrapping_int64():
    seeds = [0, 1, 77, 2**62 + 12345, 2**63 - 1]
    counters = [0, 1, 5, 1023, 10**6]
    pairs = [(s, c) for s in seeds for c in counters]
    ours = seeded_uniform(torch.tensor([s for s, _ in pairs]), torch.tensor([c for _, c in pairs]))
    assert ours.tolist() == [uniform(splitmix64(s, c)) for s, c in pairs]


# (seed, counter, splitmix64's output): the first four by the definition and the published
# vectors above, the rest computed once with `splitmix64` (checked against them) and pasted here.
RECORDED_DRAWS = [
    (0, 0, 0x0),  # the mix of 0 is 0: draw 0 of seed 0 is 0.0
    (0, 1, 0xE220A8397B1DCDAF),
    (1234567, 1, 6457827717110365317),
    (1234567, 5, 16408922859458223821),
    (1, 0, 0x5692161D100B05E5),
    (42, 7, 0x37E9671C45376D5D),
    (2**63 - 1, 0, 0x5A682AFE7965DEBD),
    (2**63 - 1, 1, 0x2A67D7552E039EA7),
    (2**63 - 2, 1023, 0x88A1406FC26ED8A8),
    (2**62 + 12345, 10**6, 0x3E1F115B6FDE7B54),
    (987654321, 2**40, 0x337EF807ADE26350),
    (2**63 - 1, 2**62, 0x144B3B581C062650),  # seed · counter · γ wraps many times over
]


def test_seeded_uniform_gives_the_recorded_draws():
    seeds, counters, outputs = zip(*RECORDED_DRAWS)
    ours = seeded_uniform(torch.tensor(seeds), torch.tensor(counters))
    assert ours.tolist() == [uniform(x) for x in outputs]
    assert [uniform(splitmix64(s, c)) for s, c in zip(seeds, counters)] == [uniform(x) for x in outputs]


# Rows of FIXED_LOGITS sampled at counters 0..11: (seed, temperature, top_k, top_p), tokens drawn.
COUNTERS = range(12)
RECORDED_SAMPLER_TOKENS = [
    ((7, 1.0, 0, 1.0), [0, 1, 0, 5, 1, 1, 0, 1, 0, 0, 1, 0]),
    ((7, 0.8, 6, 0.9), [0, 0, 0, 2, 1, 0, 0, 0, 0, 0, 0, 0]),
    ((2**63 - 1, 1.3, 0, 0.8), [0, 0, 4, 4, 0, 0, 0, 0, 1, 3, 3, 3]),
]


def reference_token(seed: int, temperature: float, top_k: int, top_p: float, counter: int) -> int:
    """The draw by the definitions alone, in float64: temperature, top-k, the nucleus, then the
    first token whose cumulative probability passes u · total."""
    logits = FIXED_LOGITS.double() / temperature
    order = logits.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k else order
    probs = torch.zeros_like(logits)
    probs[kept] = logits[kept].softmax(-1)
    nucleus, mass = [], 0.0
    for index in order:
        if mass >= top_p:
            break
        nucleus.append(index)
        mass += float(probs[index])
    filtered = torch.zeros_like(probs)
    filtered[nucleus] = probs[nucleus]
    target = uniform(splitmix64(seed, counter)) * float(filtered.sum())
    return int((filtered.cumsum(-1) > target).nonzero()[0])


def test_choose_tokens_draws_the_recorded_tokens():
    rows = [(case, counter) for case, _ in RECORDED_SAMPLER_TOKENS for counter in COUNTERS]
    seed, temperature, top_k, top_p = (list(column) for column in zip(*(case for case, _ in rows)))
    vocab = FIXED_LOGITS.shape[0]
    params = sampling_tensors(len(rows), vocab, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    tokens, _ = choose_tokens(FIXED_LOGITS.expand(len(rows), vocab), params, torch.tensor([c for _, c in rows]))
    recorded = [token for _, tokens_of_case in RECORDED_SAMPLER_TOKENS for token in tokens_of_case]
    assert tokens.tolist() == recorded
    assert [reference_token(*case, counter) for case, counter in rows] == recorded


# Two requests on the tiny test model (tests/conftest.py, weights from seed 0), run together:
# (prompt, sampling parameters, each sequence's tokens). Recorded on the CPU; checked once, and
# by the test below each time, against transformers' model with `splitmix64` drawing.
RECORDED_ENGINE_TOKENS = [
    (
        [464, 2068, 7586, 21831],  # "The quick brown fox"
        dict(seed=1234, temperature=0.9, top_k=40, top_p=0.95, max_new_tokens=12),
        [[13678, 29986, 31018, 26317, 13044, 20037, 36656, 10491, 14366, 37220, 27152, 47875]],
    ),
    (
        [7454, 2402, 257, 640],  # "Once upon a time"
        dict(seed=2**64 - 1, temperature=1.2, top_p=0.9, max_new_tokens=8, num_return_sequences=2),
        [
            [6278, 16302, 5667, 8831, 27480, 40489, 42564, 41997],
            [16277, 5665, 8846, 27425, 40476, 42569, 42035, 6844],
        ],
    ),
]


@pytest.fixture
def cpu_only(device):
    if device.type != "cpu":
        # The sampler's values above hold on every device; these come from the CPU's logits.
        pytest.skip("tokens recorded on the CPU; other logits may put a draw across a cut-off")


@pytest.mark.parametrize("batched_rows", [1, 16], ids=["batched", "row by row"])
def test_seeded_requests_give_the_recorded_tokens(make_engine, monkeypatch, cpu_only, batched_rows):
    monkeypatch.setattr(layout_module, "BATCHED_ROWS", batched_rows)
    requests = [make_request(prompt, do_sample=True, **params) for prompt, params, _ in RECORDED_ENGINE_TOKENS]
    results = make_engine().generate(requests)
    assert [[s.token_ids for s in result.sequences] for result in results] == [t for _, _, t in RECORDED_ENGINE_TOKENS]


@torch.no_grad()
def test_the_recorded_tokens_are_the_contract_on_transformers_model(hf_model, cpu_only):
    for prompt, params, sequences in RECORDED_ENGINE_TOKENS:
        warpers = [TemperatureLogitsWarper(params["temperature"]), TopPLogitsWarper(params["top_p"])]
        if params.get("top_k"):
            warpers.insert(1, TopKLogitsWarper(params["top_k"]))
        for index, tokens in enumerate(sequences):
            seed = (params["seed"] + index * GAMMA) % 2**63
            ids = list(prompt)
            for token in tokens:
                scores = hf_model(torch.tensor([ids], device=hf_model.device)).logits[:, -1].float()
                for warper in warpers:
                    scores = warper(None, scores)
                cdf = scores.softmax(-1).double().cumsum(-1)[0].cpu()  # [V]
                target = uniform(splitmix64(seed, len(ids))) * float(cdf[-1])
                assert int((cdf > target).nonzero()[0]) == token, (params, index, len(ids))
                ids.append(token)
