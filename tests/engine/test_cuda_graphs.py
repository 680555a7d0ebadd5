"""CUDA graphs (the CUDA lane only: GPT2_TEST_DEVICE=cuda, `make test-cuda`): decode steps
replayed from captured graphs give the tokens eager decoding gives, greedy and seeded sampling,
as requests join and leave."""

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


def staggered(engine) -> dict[str, list[int]]:
    """Requests of different lengths arriving while others decode; token ids by request."""
    requests = [
        make_request(random_prompt(3 + 5 * i, seed=i), request_id=f"r{i}", max_new_tokens=12 + 3 * i,
                     do_sample=i % 2 == 1, temperature=0.8, top_p=0.9, seed=100 + i)
        for i in range(6)
    ]
    results = {}
    for step, request in enumerate(requests):
        engine.submit([request])
        results.update((f.request_id, f) for f in engine.step().finished)
    results.update((f.request_id, f) for f in run_until_idle(engine))
    return {rid: result.sequences[0].token_ids for rid, result in results.items()}


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
    assert staggered(graphs) == staggered(eager)
