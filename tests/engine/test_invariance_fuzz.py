"""A seeded request's output does not depend on its neighbours (docs/batch-invariance.md):
a bounded run of the differential fuzzer (tests/engine/invariance_fuzz.py; `make fuzz-invariance`
runs a long one), the sampler's part of it on the test device (what holds on CUDA too), and the
cases that once broke it, as plain tests."""

from __future__ import annotations

import io
import os
import random
import time

import pytest
import torch

from model.linear import linear, pack
from model.logits_processors import Controls
from model.sampling import SamplingTensors, choose_tokens
from model.scoring import top_alternatives
from tests.conftest import TEST_DEVICE
from tests.engine.conftest import make_request
from tests.engine.invariance_fuzz import Models, cpu_features, failure, fuzz, write_fuzz_model

V = 50257
cpu_only = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="on CUDA the model's logits change with the batch (cuBLAS)")


@pytest.fixture(scope="module")
def fuzz_models(tmp_path_factory, default_model_dir):
    return Models(write_fuzz_model(tmp_path_factory.mktemp("fuzz-gpt2")), torch.device("cpu"))


@cpu_only
def test_bounded_fuzz_finds_no_request_that_depends_on_its_neighbours(fuzz_models):
    cases = int(os.environ.get("GPT2_FUZZ_CASES", "12"))
    report = io.StringIO()
    started = time.monotonic()
    found = fuzz(fuzz_models, cases, seed=int(os.environ.get("GPT2_FUZZ_SEED", "31")), features=cpu_features(), out=report)
    print(f"{cases} cases in {time.monotonic() - started:.1f} s")
    assert not found, report.getvalue()


def test_a_resumed_run_runs_the_cases_the_whole_run_would_have_from_there(fuzz_models, monkeypatch):
    import tests.engine.invariance_fuzz as harness  # noqa: PLC0415

    ran = []
    monkeypatch.setattr(harness, "failure", lambda models, case: ran.append(case))
    fuzz(fuzz_models, 5, seed=7, features=cpu_features(), out=io.StringIO())
    whole, ran[:] = list(ran), []
    fuzz(fuzz_models, 5, seed=7, features=cpu_features(), out=io.StringIO(), skip=3)
    assert ran == whole[3:]


# --- the sampler alone, on the test device ------------------------------------------------------
def random_rows(rng: random.Random, count: int, device: torch.device) -> tuple[torch.Tensor, list[dict]]:
    """Flat logits on a coarse grid (many exact ties, as a random model's near-uniform rows have)
    and each row's settings."""
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = (torch.randn(count, V, generator=generator) * rng.choice([0.01, 0.3, 3.0]) * 64).round() / 64
    rows = [{"temperature": rng.choice([0.7, 1.0, 1.2]), "top_k": rng.choice([V, 1, 40, 3000]),
             "top_p": rng.choice([1.0, 0.5, 0.8]), "min_p": rng.choice([0.0, 0.0, 0.1]),
             "typical_p": rng.choice([1.0, 0.2, 0.8, 0.95]), "do_sample": rng.random() < 0.8,
             "seed": rng.randrange(2**40), "counter": rng.randrange(1000), "top_logprobs": rng.randint(0, 5)}
            for _ in range(count)]
    return logits.to(device), rows


def sample(logits: torch.Tensor, rows: list[dict]):
    device = logits.device

    def column(key, dtype=torch.float32):
        return torch.tensor([r[key] for r in rows], dtype=dtype, device=device)

    params = SamplingTensors(
        temperature=column("temperature"), top_k=column("top_k", torch.long), top_p=column("top_p"),
        repetition_penalty=torch.ones(len(rows), device=device), do_sample=column("do_sample", torch.bool),
        seed=column("seed", torch.long), any_sample=True, any_top_k_top_p=True, any_penalty=False,
    )
    floats = torch.stack([torch.zeros(len(rows), device=device)] * 2 + [column("min_p"), column("typical_p")], dim=1)
    params.controls = Controls(None, None, floats, None, None, None, None, None, None, 0, None, warpers=True)
    tokens, logprobs = choose_tokens(logits, params, column("counter", torch.long))
    n = max(r["top_logprobs"] for r in rows)
    ids, top = top_alternatives(logits, n)
    return [(int(t), float(lp), ids[i, : r["top_logprobs"]].tolist(), top[i, : r["top_logprobs"]].tolist())
            for i, (t, lp, r) in enumerate(zip(tokens.tolist(), logprobs.tolist(), rows))]


@pytest.mark.parametrize("threads", [1, 2])
def test_the_sampler_gives_each_row_the_same_choice_alone_and_in_any_batch(device, threads):
    """Given the same logits, a row's token, log-prob and alternatives do not depend on the rows
    beside it, their settings or the thread count: this holds on CUDA too."""
    rng = random.Random(31)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(6):
            logits, rows = random_rows(rng, rng.choice([3, 8, 17]), device)
            together = sample(logits, rows)
            for i in range(len(rows)):
                assert sample(logits[i : i + 1], rows[i : i + 1])[0] == together[i], rows[i]
    finally:
        torch.set_num_threads(before)


def test_ties_at_a_cut_off_keep_the_lowest_token_ids(device):
    """transformers leaves equal logits at a top-p or typical-p edge to its sort's kernel; here
    the lowest ids stay, whatever the row's neighbours or the device."""
    logits = torch.full((1, V), -20.0, device=device)
    logits[0, [5, 9, 700, 40000]] = 1.0  # four equal tokens holding almost all the mass
    # top-p 0.4: two of them reach it; typical-p: all four are equally far from the entropy.
    from model.logits_processors import apply_typical_p
    from model.sampling import apply_top_k_top_p

    kept = apply_top_k_top_p(logits, torch.tensor([V], device=device), torch.tensor([0.4], device=device))
    assert (kept[0] > float("-inf")).nonzero().flatten().tolist() == [5, 9]
    kept = apply_typical_p(logits, torch.tensor([0.3], device=device))
    assert (kept[0] > float("-inf")).nonzero().flatten().tolist() == [5, 9, 700, 40000]  # equal distances all stay


# --- regressions --------------------------------------------------------------------------------
# Cases the fuzzer found, as it printed them (shrunk).
FOUND = [
    # Draft verification ran the draft's queries in one attention call: other bits than decoding,
    # and with them other alternatives (int8 rounds each row's activations).
    {"features": {"speculative": True, "prefix_caching": True, "max_prefill_tokens": 5, "quantize": "int8", "threads": 1},
     "target": {"prompt": [31594, 2714, 31594, 2714, 31594], "params": {"max_new_tokens": 5, "top_logprobs": 2}, "arrives": 0},
     "neighbours": []},
    # A drafted step read after its neighbour was cancelled wrote that neighbour's last token into
    # the slot the target had just been packed into (InputBatch.set_drafted): the target then fed
    # the neighbour's token (overlap on, cases 70 and 531 of seed 4646).
    {"features": {"speculative": True, "prefix_caching": False, "max_prefill_tokens": 512, "quantize": "none",
                  "threads": 1, "overlap": True},
     "target": {"prompt": [27155, 43504], "params": {"max_new_tokens": 8, "repetition_penalty": 1.3}, "arrives": 1},
     "neighbours": [{"prompt": [27155, 6802, 14022, 47485, 41879, 20179, 17063, 38235, 44848, 46820, 23136, 29504, 33818],
                     "params": {"max_new_tokens": 12}, "arrives": 0, "cancel_at": 5}]},
]


@cpu_only
@pytest.mark.parametrize("case", FOUND, ids=range(len(FOUND)))
def test_cases_the_fuzzer_found(fuzz_models, case):
    from model.quantized import quantize_problem

    quantize = case["features"]["quantize"]
    if quantize != "none" and quantize_problem(quantize, "cpu", torch.float32):
        pytest.skip(quantize_problem(quantize, "cpu", torch.float32))
    assert failure(fuzz_models, case) is None


@cpu_only
@pytest.mark.parametrize("inputs", [1536, 3072])
def test_a_lone_row_of_a_wide_product_gets_the_batched_rows_bits(inputs):
    """oneDNN's kernel for a single row sums GPT-2's 3,072-wide MLP projection in another order
    than for two or more rows; the issue's request sampled other tokens from it (typical_p)."""
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(768, inputs, generator=generator) * 0.02, torch.randn(768, generator=generator)
    packed = pack(weight)
    x = torch.randn(24, inputs, generator=generator)
    batched = linear(x, weight, bias, packed)
    for row in (0, 7, 23):
        assert torch.equal(linear(x[row : row + 1], weight, bias, packed)[0], batched[row])
        assert torch.equal(linear(x[row], weight, bias, packed), batched[row])  # [in] -> [out]


ISSUE_TEXT = "shall to the the rides shall the rides in the and and shall shall of the in while of the in speak"
ISSUE_PARAMS = dict(max_new_tokens=28, do_sample=True, temperature=1.2, seed=3022, typical_p=0.8)


def issue_neighbours(tokenizer, longest: int = 40) -> list:
    """23 requests as the issue sent them: greedy and sampled, some with stop strings or a penalty,
    each up to `longest` new tokens."""
    rng = random.Random(3022)
    neighbours = []
    for i in range(23):
        prompt = tokenizer.encode(" ".join(rng.choice(ISSUE_TEXT.split()) for _ in range(rng.randint(3, 30))))
        kind = i % 4
        params = {"max_new_tokens": rng.randint(5, longest)}
        if kind:
            params.update(do_sample=True, seed=rng.randrange(2**30), temperature=0.9, top_p=0.9)
        if kind == 2:
            params["stop"] = ("e",)
        if kind == 3:
            params["repetition_penalty"] = 1.3
        neighbours.append(make_request(prompt, request_id=f"n{i}", **params))
    return neighbours


@cpu_only
@pytest.mark.slow
def test_the_issues_typical_p_request_gives_its_solo_tokens_among_23_neighbours(default_model_dir, tokenizer):
    from service.inprocess import Engine, EngineConfig
    from weights.checkpoint import load_model

    model = load_model(default_model_dir)
    config = EngineConfig(max_slots=24, max_len=128, prefix_caching=False, max_prefill_tokens=256)
    prompt = tokenizer.encode(ISSUE_TEXT)
    [alone] = Engine(model, tokenizer, config).generate([make_request(prompt, request_id="solo", **ISSUE_PARAMS)])
    requests = issue_neighbours(tokenizer)
    requests.insert(11, make_request(prompt, request_id="it", **ISSUE_PARAMS))
    results = {r.request_id: r for r in Engine(model, tokenizer, config).generate(requests)}
    assert results["it"].sequences[0].token_ids == alone.sequences[0].token_ids
    assert results["it"].sequences[0].logprobs == alone.sequences[0].logprobs


# Issue 46: six seeded targets, each alone, then three times beside the 23 neighbours in one engine
# with the default settings (prefix caching on, a 512-token prefill budget that the batch's prompts
# overrun): from the second time on the cache holds the target's prompt and the neighbours', so its
# prompt is prefilled from a cached prefix (down to its last token alone) instead of cold.
ISSUE_46_TARGETS = [dict(typical_p=0.8, temperature=1.2), dict(typical_p=0.95), dict(min_p=0.05),
                    dict(min_p=0.3, temperature=1.5), dict(top_k=5), dict(top_k=40, temperature=0.8)]


def issue_46_runs(model, tokenizer, new_tokens: int) -> list[tuple[int, int, object, object]]:
    """(target, repetition, its result beside the neighbours, its solo result) for every run;
    targets and neighbours write up to `new_tokens` tokens (the issue's first differed at its first)."""
    from service.inprocess import Engine, EngineConfig

    config = EngineConfig(max_slots=24, max_len=128)
    words = ISSUE_TEXT.split()
    targets = [make_request(tokenizer.encode(" ".join(words[i:] + words[:i])), request_id="it", max_new_tokens=new_tokens,
                            do_sample=True, seed=46 + i, **params) for i, params in enumerate(ISSUE_46_TARGETS)]
    solo = [Engine(model, tokenizer, config).generate([target])[0] for target in targets]
    engine = Engine(model, tokenizer, config)
    runs = []
    for repetition in range(3):
        for i, target in enumerate(targets):
            requests = issue_neighbours(tokenizer, longest=new_tokens)
            requests.insert(11, target)
            results = {r.request_id: r for r in engine.generate(requests)}
            runs.append((i, repetition, results["it"], solo[i]))
    return runs


@cpu_only
@pytest.mark.slow
def test_the_issue_46_seeded_targets_give_their_solo_tokens_beside_neighbours_with_prefix_caching(default_model_dir,
                                                                                                  tokenizer):
    """On the random 124M model, as the issue ran it: its near-uniform rows put many tokens on
    typical-p's cut-off, where a last-bit change in the logits moves the draw."""
    from weights.checkpoint import load_model

    runs = issue_46_runs(load_model(default_model_dir), tokenizer, new_tokens=6)
    differ = [(i, repetition) for i, repetition, beside, alone in runs
              if (beside.sequences[0].token_ids, beside.sequences[0].logprobs)
              != (alone.sequences[0].token_ids, alone.sequences[0].logprobs)]
    assert not differ, f"{len(runs) - len(differ)} of {len(runs)} runs equal their solo run; (target, repetition) apart: {differ}"


@cpu_only
def test_a_prompt_token_scored_alone_gets_the_bits_it_gets_among_others():
    """A prompt cut into other chunks scores a position alone (a chunk of one) or among others;
    logsumexp summed a lone row across threads (the fuzzer found it, 2 threads)."""
    from model.scoring import score_tokens

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seed in range(30):  # logsumexp rounded 4 of these 90 rows otherwise alone
            generator = torch.Generator().manual_seed(seed)
            logits = torch.randn(12, V, generator=generator) * (0.1, 1.0, 8.0)[seed % 3]
            tokens = torch.randint(0, V, (12,), generator=generator)
            together = score_tokens(logits, tokens, 3)
            for row in (0, 5, 11):
                alone = score_tokens(logits[row : row + 1], tokens[row : row + 1], 3)
                assert torch.equal(alone.logprobs[0], together.logprobs[row]), (seed, row)
                assert torch.equal(alone.top_logprobs[0], together.top_logprobs[row]), (seed, row)
    finally:
        torch.set_num_threads(before)
