"""A GPT-2-architecture checkpoint with Cerebras-GPT's and Stanford CRFM's options, served end to
end by the engine from a folder: greedy tokens equal transformers' generate(), log-probabilities
its log-softmax, batched with prompts of other lengths, eager and static decode alike."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import hf_generate, make_request, random_prompt
from tests.model.checkpoint_options import ENGINE_CASE, load_both, write_options_model

LOGPROB_TOLERANCE = 1e-4
# (prompt length, new tokens)
REQUESTS = [(3, 12), (17, 6), (40, 9)]


@pytest.fixture(scope="module")
def served(tmp_path_factory, device):
    folder = write_options_model(tmp_path_factory.mktemp("options-model"), ENGINE_CASE)
    return load_both(folder, ENGINE_CASE, device)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static-decode"])
def test_engine_serves_the_options_as_transformers_computes_them(served, make_engine, static):
    ours, reference = served
    engine = make_engine(model=ours, max_slots=len(REQUESTS), static_decode=static)
    prompts = [random_prompt(length, seed=length) for length, _ in REQUESTS]
    results = engine.generate([make_request(p, max_new_tokens=new) for p, (_, new) in zip(prompts, REQUESTS)])
    for prompt, (_, new), result in zip(prompts, REQUESTS, results):
        sequence = result.sequences[0]
        assert sequence.token_ids == hf_generate(reference, prompt, new)
        with torch.no_grad():
            full = torch.tensor([prompt + sequence.token_ids], device=reference.device)
            logprobs = reference(full).logits[0].log_softmax(-1)
        expected = [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(sequence.token_ids)]
        assert sequence.logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
    assert engine.cache.slots_used == 0
