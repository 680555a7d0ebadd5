"""LoRA adapters in the engine: rows of several adapters and the base in one batch, each getting
what it gets alone (and what peft's model generates); the prefix cache kept per adapter; adapters
loaded and unloaded while requests run, losing nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.engine.ngram_drafter import NgramSettings
from tests.engine.conftest import assert_same_outputs, hf_generate, make_request, random_prompt, run_until_idle
from tests.model.test_lora import PEFT_CONFIGS, load_reference_model, peft_adapter

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    return {name: peft_adapter(tmp_path_factory.mktemp(name), tiny_model_dir, seed=seed, **PEFT_CONFIGS[config])
            for seed, (name, config) in enumerate([("poems", "all-modules"), ("comedies", "rslora")])}


def adapted_engine(make_engine, adapter_dirs, **config):
    return make_engine(adapters=tuple((name, str(folder)) for name, folder in adapter_dirs.items()), **config)


def outcome(finished) -> list:
    return [(s.token_ids, s.logprobs, s.finish_reason, s.score) for s in finished.sequences] + [finished.prompt_logprobs]


# (adapter, prompt seed, prompt length, parameters)
MIXED = [
    (None, 1, 5, dict(max_new_tokens=10)),
    ("poems", 1, 5, dict(max_new_tokens=10)),  # the same prompt as the base row above
    ("comedies", 2, 9, dict(max_new_tokens=12, do_sample=True, seed=3, top_k=40)),
    ("poems", 3, 14, dict(max_new_tokens=8, do_sample=True, seed=4, num_return_sequences=2)),
    (None, 4, 6, dict(max_new_tokens=11, do_sample=True, seed=5)),
    ("comedies", 5, 30, dict(max_new_tokens=6, top_logprobs=2)),
    ("poems", 6, 7, dict(max_new_tokens=6, num_beams=3, num_return_sequences=2)),
    ("comedies", 7, 12, dict(max_new_tokens=5, prompt_logprobs=True, top_logprobs=1)),
    ("poems", 8, 4, dict(max_new_tokens=12, grammar='%llguidance {}\nstart: /[a-z]{2,6}( [a-z]{2,6}){0,3}/')),
]


def adapted_requests(entries=MIXED, config: dict | None = None) -> list:
    batch = [make_request(random_prompt(length, seed), f"r{i}", **params) for i, (_, seed, length, params) in enumerate(entries)]
    for request, (adapter, *_rest) in zip(batch, entries):
        request.adapter = adapter
        if config and "speculative" in config:  # prompts that repeat themselves: drafts from the first decode step
            request.prompt_ids = request.prompt_ids[:4] * 4
    return batch


def undrafted(config: dict) -> dict:
    """The reference's settings: the same without drafts. Speculation promises the tokens and bits
    decoding gives without it, and a reference that drafts too would verify its drafts the same
    way as the batch does, right or wrong (with the base's weights instead of the adapter's, say)."""
    return {key: value for key, value in config.items() if key != "speculative"}


@pytest.mark.parametrize("config", [
    dict(max_slots=8),
    dict(max_slots=4, max_prefill_tokens=8),  # admissions as others finish, prompts in chunks
    dict(max_slots=8, overlap=True),
    dict(max_slots=8, static_decode=True),  # a step with adapter rows runs eagerly
    dict(max_slots=8, speculative=NgramSettings(min_n=1, max_n=3, tokens=4, weight_pass_rows=float("inf"))),
])
def test_each_row_gets_what_it_gets_alone(make_engine, adapter_dirs, config):
    alone = {}  # each in an engine of its own with the same settings (a prefill budget cuts prompts its way)
    for request in adapted_requests(config=config):
        [alone[request.request_id]] = [outcome(f) for f in adapted_engine(make_engine, adapter_dirs, **undrafted(config)).generate([request])]
    engine = adapted_engine(make_engine, adapter_dirs, **config)
    together = {f.request_id: outcome(f) for f in engine.generate(adapted_requests(config=config))}
    if config.get("static_decode"):
        # Steps with adapter rows run eagerly, the others padded to a graph's shape: the same
        # tokens, not the same last bits (as graphs beside eager steps on a GPU).
        together, alone = ({k: [seq[0] for seq in v[:-1]] for k, v in d.items()} for d in (together, alone))
    assert_same_outputs(together, alone)
    assert alone["r0"] != alone["r1"]  # the adapter changes what the model writes
    assert engine.cache.slots_used == 0


@pytest.mark.parametrize("config", [
    dict(max_slots=32),
    dict(max_slots=32, overlap=True),
    # a step with drafts (ModelRunner._decode_drafted): the undrafted rows' adapters from the column
    dict(max_slots=32, speculative=NgramSettings(min_n=1, max_n=3, tokens=4, weight_pass_rows=float("inf"))),
])
def test_rows_laid_out_from_the_batchs_arrays_get_what_they_get_alone(make_engine, adapter_dirs, config):
    """With 16 or more running (layout.BATCHED_ROWS) a forward's adapters come from the input
    batch's column, indexed by the rows' slots: written at admission and carried by packing moves
    as requests finish."""
    entries = [(adapter, seed + 10 * copy, length + copy, params) for copy in range(3) for adapter, seed, length, params in MIXED]
    alone = {}
    for request in adapted_requests(entries, config):
        [alone[request.request_id]] = [outcome(f) for f in adapted_engine(make_engine, adapter_dirs, **undrafted(config)).generate([request])]
    engine = adapted_engine(make_engine, adapter_dirs, **config)
    assert_same_outputs({f.request_id: outcome(f) for f in engine.generate(adapted_requests(entries, config))}, alone)


@torch.inference_mode()
def test_an_adapters_greedy_tokens_are_peft_models(make_engine, adapter_dirs, tiny_model_dir):
    reference = peft.PeftModel.from_pretrained(load_reference_model(tiny_model_dir), adapter_dirs["poems"]).eval()
    engine = adapted_engine(make_engine, adapter_dirs)
    for seed, length in [(7, 4), (8, 20)]:
        prompt = random_prompt(length, seed)
        request = make_request(prompt, max_new_tokens=12)
        request.adapter = "poems"
        [ours] = engine.generate([request])
        assert ours.sequences[0].token_ids == hf_generate(reference, prompt, 12)


def test_a_prompt_reuses_only_keys_its_own_adapter_computed(make_engine, adapter_dirs):
    prompt = random_prompt(20, seed=11)
    engine = adapted_engine(make_engine, adapter_dirs)
    base, adapted = make_request(prompt, max_new_tokens=4), make_request(prompt, max_new_tokens=4)
    adapted.adapter = "poems"
    engine.generate([base])  # the base's keys of this prompt's first block are now cached
    engine.submit([adapted])
    engine.step()
    assert engine.scheduler.prefix.enabled and engine.scheduler.running[0].reused == 0
    [reused] = run_until_idle(engine)
    fresh = make_request(prompt, max_new_tokens=4)
    fresh.adapter = "poems"
    [alone] = adapted_engine(make_engine, adapter_dirs).generate([fresh])
    assert outcome(reused) == outcome(alone)
    again = make_request(prompt, max_new_tokens=4)
    again.adapter = "poems"
    engine.submit([again])
    engine.step()
    assert engine.scheduler.running[0].reused > 0  # its own adapter's keys are reused


def test_unloading_while_requests_run_loses_nothing(make_engine, adapter_dirs):
    # Prompts of a full block and more, which the prefix cache keeps.
    entries = [("poems", 20 + i, 20, dict(max_new_tokens=12, do_sample=True, seed=i)) for i in range(3)]
    expected = {f.request_id: outcome(f) for f in adapted_engine(make_engine, adapter_dirs).generate(adapted_requests(entries))}
    engine = adapted_engine(make_engine, adapter_dirs)
    engine.submit(adapted_requests(entries))
    done = {}
    for _ in range(3):
        done.update((f.request_id, outcome(f)) for f in engine.step().finished)
    engine.core.adapters.unload("poems")
    assert "poems" not in engine.core.adapters.names
    late = make_request([1, 2, 3], max_new_tokens=2)
    late.adapter = "poems"
    with pytest.raises(ValueError, match="no LoRA adapter named 'poems'"):
        engine.submit([late])
    assert "poems" in engine.core.adapters.set  # still resident: requests use it
    done.update((f.request_id, outcome(f)) for f in run_until_idle(engine))
    assert done == expected
    engine.step()  # an idle step frees it
    assert "poems" not in engine.core.adapters.set
    # Loaded again (another adapter under its old index): nothing of the old one is reused.
    engine.core.adapters.load("other", str(adapter_dirs["comedies"]))
    request = make_request(random_prompt(20, 20), max_new_tokens=5)
    request.adapter = "other"
    [reloaded] = engine.generate([request])
    fresh = make_request(random_prompt(20, 20), max_new_tokens=5)
    fresh.adapter = "comedies"
    [alone] = adapted_engine(make_engine, adapter_dirs).generate([fresh])
    assert outcome(reloaded) == outcome(alone)


def test_unknown_adapters_are_refused_and_a_bad_folder_changes_nothing(make_engine, adapter_dirs, tmp_path):
    engine = adapted_engine(make_engine, adapter_dirs)
    request = make_request([1, 2, 3], max_new_tokens=2)
    request.adapter = "sonnets"
    with pytest.raises(ValueError, match="no LoRA adapter named 'sonnets'"):
        engine.submit([request])
    with pytest.raises(ValueError, match="adapter_config.json"):
        engine.core.adapters.load("empty", str(tmp_path))
    assert engine.core.adapters.names == ["poems", "comedies"]
