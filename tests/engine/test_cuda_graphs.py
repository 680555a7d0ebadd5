"""CUDA graphs (the CUDA lane only: GPT2_TEST_DEVICE=cuda, `make test-cuda`): decode steps
replayed from captured graphs give the tokens eager decoding gives, greedy and seeded sampling,
as requests join and leave, up to a choice on a cut-off (padded shapes change the last bits)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import make_request, random_prompt, run_until_idle
from tests.model.checkpoint_options import ENGINE_CASE, write_options_model
from weights.checkpoint import load_model


@pytest.fixture
def cuda_only(device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need the CUDA lane (GPT2_TEST_DEVICE=cuda)")


def staggered(engine) -> dict[str, object]:
    """Requests of different lengths arriving while others decode; each one's sequence by request id
    (token ids, their log-probs, and the two most likely tokens at each step)."""
    requests = [
        make_request(random_prompt(3 + 5 * i, seed=i), request_id=f"r{i}", max_new_tokens=12 + 3 * i,
                     do_sample=i % 2 == 1, temperature=0.8, top_p=0.9, seed=100 + i, top_logprobs=2)
        for i in range(6)
    ]
    results = {}
    for step, request in enumerate(requests):
        engine.submit([request])
        results.update((f.request_id, f) for f in engine.step().finished)
    results.update((f.request_id, f) for f in run_until_idle(engine))
    return {rid: result.sequences[0] for rid, result in results.items()}


# A replayed graph runs padded batch shapes, so its logits differ from the eager step's in the last
# bits (float16: a few units of 0.008 at logits ~13). Tokens must agree until the first step
# whose choice sits on a cut-off: greedy, the eager step's two best within TIE of each other;
# sampled, a draw at the edge between two tokens. Up to there the log-probs agree within
# LOGPROB_TOLERANCE: a graph reading a wrong block, position or row would be off by far more.
TIE = {torch.float32: 1e-3, torch.float16: 0.05}
LOGPROB_TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.05}


def compared_tokens(replayed, eager, dtype: torch.dtype, greedy: bool) -> int:
    """How many tokens of one request agree before the first choice on a cut-off; fails on a
    difference anywhere else, or on log-probs apart by more than the tolerance."""
    for i, (token, expected) in enumerate(zip(replayed.token_ids, eager.token_ids)):
        assert abs(replayed.logprobs[i] - eager.logprobs[i]) <= LOGPROB_TOLERANCE[dtype] or token != expected, \
            (i, replayed.logprobs[i], eager.logprobs[i])
        if token != expected:
            best, second = (logprob for _, logprob in eager.top_logprobs[i][:2])
            assert not greedy or best - second <= TIE[dtype], (i, token, expected, best, second)
            return i
    assert len(replayed.token_ids) == len(eager.token_ids)
    return len(eager.token_ids)


@pytest.fixture(params=["gpt2", "checkpoint-options"])
def served_model(request, tiny_model, tmp_path_factory, device):
    """GPT-2's arithmetic, or float16 with CRFM's attention options (float32 scores in the
    captured graphs), Cerebras-GPT's exact GELU and 2,048 positions."""
    if request.param == "gpt2":
        return tiny_model
    folder = write_options_model(tmp_path_factory.mktemp("options-model"), ENGINE_CASE)
    return load_model(folder, device=device, dtype=torch.float16)


def test_graph_replays_give_eager_tokens(cuda_only, make_engine, served_model):
    graphs = make_engine(model=served_model, max_slots=8, static_decode=True)
    assert graphs.core.runner.static_decode.graphs, "no graph was captured (see the warning logged)"
    eager = make_engine(model=served_model, max_slots=8)
    replayed, expected = staggered(graphs), staggered(eager)
    assert replayed.keys() == expected.keys()
    agreed = sum(compared_tokens(replayed[rid], expected[rid], served_model.dtype, greedy=int(rid[1:]) % 2 == 0)
                 for rid in expected)
    assert agreed >= 0.8 * sum(len(s.token_ids) for s in expected.values())  # ties are rare: most tokens compared
