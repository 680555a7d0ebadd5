"""The engine runs unchanged on half-precision weights and cache (the CUDA production modes).

There is no GPU here; bfloat16 and float16 on the CPU run the same code paths (cache dtype,
logits cast to float32 for sampling, one host copy per step). Reference: transformers in float32.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import make_request, random_prompt
from weights.checkpoint import load_model

# Half-precision logits of a tiny model differ from float32 by up to a few hundredths.
HALF_LOGPROB_TOLERANCE = 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_engine_agrees_with_float32_reference(tiny_model_dir, make_engine, hf_model, dtype):
    model = load_model(tiny_model_dir, dtype=dtype)
    engine = make_engine(model=model)
    assert engine.cache.keys.dtype == dtype
    prompts = [random_prompt(n, seed=n) for n in (5, 12)]
    results = engine.generate(
        [make_request(prompts[0], max_new_tokens=4),
         make_request(prompts[1], max_new_tokens=4, do_sample=True, seed=1, top_k=20, repetition_penalty=1.2)]
    )
    for prompt, result in zip(prompts, results):
        sequence = result.sequences[0]
        assert len(sequence.token_ids) == 4
        with torch.no_grad():
            logprobs = hf_model(torch.tensor([prompt + sequence.token_ids], device=hf_model.device)).logits[0].log_softmax(-1)
        expected = [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(sequence.token_ids)]
        assert sequence.logprobs == pytest.approx(expected, abs=HALF_LOGPROB_TOLERANCE)
    # Greedy picks a token the float32 model ranks first or as good as first within tolerance.
    first = results[0].sequences[0].token_ids[0]
    with torch.no_grad():
        last = hf_model(torch.tensor([prompts[0]], device=hf_model.device)).logits[0, -1].log_softmax(-1)
    assert last.max() - last[first] < HALF_LOGPROB_TOLERANCE
