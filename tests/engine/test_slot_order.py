"""The step's read path by slot order (service/engine/core.py, StepRows.in_slot_order): when
logits row b is slot b's for every sampled row, the per-slot tables are read as views of their
first B rows and the logits without a gather. Both paths must run, and give the tokens that
each request gets alone, with every per-slot table in use (seeds, penalties, controls)."""

from __future__ import annotations

import pytest

from tests.engine.conftest import assert_same_outputs, make_request, random_prompt, run_until_idle

MIXED = [
    dict(max_new_tokens=12),
    dict(max_new_tokens=9, do_sample=True, seed=11, temperature=0.8, top_k=30, top_p=0.9),
    dict(max_new_tokens=14, repetition_penalty=1.3, no_repeat_ngram_size=2),
    dict(max_new_tokens=7, do_sample=True, seed=5, presence_penalty=0.5, logit_bias=((17, 3.0),), min_p=0.05),
    dict(max_new_tokens=10, min_new_tokens=6, top_logprobs=2),
]


@pytest.fixture
def recorded_orders(make_engine):
    """An engine whose steps record whether their sampled rows were in slot order."""
    engine = make_engine(max_slots=4)
    orders: list[bool] = []
    sample = engine.core.runner.sampler.launch

    def recording(logits, rows, *rest):
        orders.append(rows.in_slot_order)
        return sample(logits, rows, *rest)

    engine.core.runner.sampler.launch = recording
    return engine, orders


def test_both_read_paths_run_and_give_each_request_its_solo_tokens(make_engine, recorded_orders):
    engine, orders = recorded_orders
    prompts = [random_prompt(4 + 3 * i, seed=40 + i) for i in range(len(MIXED))]
    alone = [make_engine(max_slots=4).generate([make_request(p, **params)])[0] for p, params in zip(prompts, MIXED)]
    # Two start together; the others join while they decode (and one waits for a free slot), so
    # steps mix a new prompt's row before the decoding rows (a gather) with plain decode steps.
    engine.submit([make_request(prompts[0], "r0", **MIXED[0]), make_request(prompts[1], "r1", **MIXED[1])])
    finished = {f.request_id: f for f in run_until_idle_after(engine, 2)}
    for i in range(2, len(MIXED)):
        engine.submit([make_request(prompts[i], f"r{i}", **MIXED[i])])
        finished.update((f.request_id, f) for f in run_until_idle_after(engine, 2))
    finished.update((f.request_id, f) for f in run_until_idle(engine))
    for i, solo in enumerate(alone):
        together = finished[f"r{i}"].sequences[0]
        assert together.token_ids == solo.sequences[0].token_ids, f"request {i}"
        assert_same_outputs(together.logprobs, solo.sequences[0].logprobs, f"request {i}")
        assert_same_outputs(together.top_logprobs, solo.sequences[0].top_logprobs, f"request {i}")
    assert True in orders and False in orders, orders


def run_until_idle_after(engine, steps: int) -> list:
    finished = []
    for _ in range(steps):
        if engine.has_work():
            finished.extend(engine.step().finished)
    return finished


def test_plain_decode_steps_read_in_slot_order(recorded_orders):
    engine, orders = recorded_orders
    engine.submit([make_request(random_prompt(5 + i, seed=i), max_new_tokens=6) for i in range(3)])
    run_until_idle(engine)
    # Prefill of three prompts into slots 0..2, then five decode steps: all in slot order.
    assert orders == [True] * 6
