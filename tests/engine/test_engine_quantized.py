"""The engine on int8 and int4 weights (`--quantize int8|int4`): greedy decoding end to end gives
the quantized model's own greedy tokens (batching, chunked prefill and prefix reuse change
nothing), a seeded request draws the same tokens alone and in a busy batch, and the engine core
process quantizes its own model only."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from model.generate import greedy_generate_uncached
from model.quantized import QUANTIZED_WEIGHTS
from service.engine.core import EngineConfig
from service.engine.process import CoreProcessConfig, build_core
from tests.conftest import TINY
from tests.engine.conftest import make_request, random_prompt
from tests.engine.test_engine_sampling import SAMPLED, busy_engine_output
from weights.checkpoint import load_model

# (prompt length, new tokens)
CASES = [(1, 12), (5, 20), (17, 16), (40, 9)]


@pytest.fixture(scope="module")
def quantized_model(tiny_model_dir, quantize_mode):
    model = load_model(tiny_model_dir)
    model.quantize(quantize_mode)
    return model


def own_greedy(model, length: int, new: int) -> list[int]:
    prompt = torch.tensor([random_prompt(length, seed=length)])  # [1, T]
    return greedy_generate_uncached(model, prompt, new)[0].tolist()


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prefill", "chunked-prefill"])
def test_greedy_through_the_engine_is_the_quantized_models_own(make_engine, quantized_model, tiny_model_dir, chunk):
    expected = {case: own_greedy(quantized_model, *case) for case in CASES}
    config = {} if chunk is None else {"max_prefill_tokens": chunk}
    engine = make_engine(model=quantized_model, max_slots=len(CASES), **config)
    results = engine.generate([make_request(random_prompt(n, seed=n), max_new_tokens=new) for n, new in CASES])
    for case, result in zip(CASES, results):
        assert result.sequences[0].token_ids == expected[case], case
        assert result.sequences[0].finish_reason == "length"
    # Alone, after the batch: the prefix cache now serves the prompts.
    for case in CASES:
        [result] = engine.generate([make_request(random_prompt(case[0], seed=case[0]), max_new_tokens=case[1])])
        assert result.sequences[0].token_ids == expected[case], case
    assert engine.cache.slots_used == 0
    # The quantized model is not the float one under another name. The float one is loaded on the
    # CPU here, where the quantized one runs (the quantized modes are CPU-only: on the CUDA lane the
    # session's `tiny_model` sits on the GPU, and the comparison would mix devices).
    ids = torch.tensor([random_prompt(9, seed=9)])
    assert not torch.equal(quantized_model(ids).logits, load_model(tiny_model_dir)(ids).logits)


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_busy_batch(make_engine, quantized_model):
    prompt = random_prompt(10, seed=1)
    [alone] = make_engine(model=quantized_model).generate([make_request(prompt, max_new_tokens=30, seed=99, **SAMPLED)])
    crowd_before = [
        make_request(random_prompt(20, seed=2), max_new_tokens=40, seed=5, **SAMPLED),
        make_request(random_prompt(7, seed=4), max_new_tokens=50, do_sample=True, temperature=1.5),
    ]
    crowd_after = [make_request(random_prompt(30, seed=5), max_new_tokens=10)]
    target = make_request(prompt, max_new_tokens=30, seed=99, **SAMPLED)
    busy = busy_engine_output(make_engine(model=quantized_model, max_slots=8), target, crowd_before, crowd_after)
    assert busy.sequences[0].token_ids == alone.sequences[0].token_ids
    assert busy.sequences[0].logprobs == alone.sequences[0].logprobs  # per-row products: bit-identical


def test_the_core_process_quantizes_its_own_model(tiny_model_dir, tokenizer, quantize_mode, caplog):
    config = CoreProcessConfig(tiny_model_dir, "cpu", "float32", None, EngineConfig(max_slots=2, max_len=TINY.n_positions),
                               tokenizer.eos_token_id)
    assert build_core(config).model.quantization == "none"
    with caplog.at_level(logging.INFO, logger="service.engine.process"):
        core = build_core(replace(config, quantize=quantize_mode))
    assert core.model.quantization == quantize_mode
    assert isinstance(core.model.h[0].attn.c_attn.packed, QUANTIZED_WEIGHTS[quantize_mode])
    # The start-up line says what is served and how many bytes it takes against float32's.
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serving")]
    float_bytes = load_model(tiny_model_dir).served_weight_bytes()
    assert f"serving {quantize_mode} weights" in line and f"{core.model.served_weight_bytes() / 1e6:.1f} MB" in line, line
    assert f"{100 * core.model.served_weight_bytes() / float_bytes:.1f}% of float32's {float_bytes / 1e6:.1f} MB" in line, line
