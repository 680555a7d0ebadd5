"""Beams as rows of the batched step: a beam request's rows are laid out from the input batch
like any other, its candidates computed for every beam request of the step at once on the device
and carried to the host in the sampler's one copy, its bookkeeping done when the step is read, and
overlap stays on for everyone (a beam request sits out the steps launched before its step is
read). Every beam request still comes out as transformers' generate(num_beams=...)."""

from __future__ import annotations

import pytest

import service.engine.layout as layout_module
from service.engine.beams import continue_beams
from service.inprocess import Engine, EngineConfig
from tests.engine.conftest import make_request, random_prompt
from tests.engine.test_beam import models  # noqa: F401 (fixture)
from tests.engine.test_beam_engine import BEAM_CASES, assert_matches, beam_request, references  # noqa: F401 (fixture)

PLAIN = [dict(max_new_tokens=12), dict(max_new_tokens=9, do_sample=True, seed=5, top_k=20),
         dict(max_new_tokens=7, top_logprobs=2, repetition_penalty=1.2)]


def run(engine: Engine, seen: dict) -> dict:
    """Every beam case and the plain requests together, arriving over the first steps; what the
    steps did goes to `seen`."""
    core = engine.core
    launches, batched, ahead = [], [], []
    real_execute, real_batch = core.runner.execute, core.runner.layout._batch

    def execute(plan, deferred):
        # A beam needs its search's answer before its next step: never stepped while in flight.
        assert all(not seq.pending for state in plan.decode if state.beam is not None for seq in state.live)
        launched = real_execute(plan, deferred)
        launches.append(launched)
        return launched

    def batch(plan):
        batched.append(plan.beams)
        return real_batch(plan)

    core.runner.execute, core.runner.layout._batch = execute, batch
    beams = {case: beam_request(case) for case in range(len(BEAM_CASES))}
    plain = [make_request(random_prompt(5, seed=30 + i), f"plain-{i}", **params) for i, params in enumerate(PLAIN)]
    arrivals = {0: [beams[0], beams[1]], 1: plain, 2: [beams[2]], 3: [beams[3]]}
    case_of = {request.request_id: case for case, request in beams.items()}
    results = {}
    for step in range(200):
        if step in arrivals:
            engine.submit(arrivals[step])
        results.update((f.request_id, f) for f in engine.step().finished)
        ahead.append(core._launched is not None and core.scheduler.beams_running > 0)  # beams ran, a step in flight
        if step > 3 and not engine.has_work():
            break
    assert engine.cache.slots_used == 0
    seen.update(launches=launches, batched=batched, case_of=case_of, ahead=ahead)
    return results


def outcome(finished) -> list:
    return [(s.token_ids, s.logprobs, s.top_logprobs, s.finish_reason) for s in finished.sequences]


@pytest.mark.parametrize("overlap", [False, True])
def test_beams_ride_the_batched_step_and_match_generate(models, tokenizer, references, monkeypatch, overlap):
    monkeypatch.setattr(layout_module, "BATCHED_ROWS", 1)  # every step from the input batch
    ours, _ = models
    seen = {}
    results = run(Engine(ours, tokenizer, EngineConfig(max_slots=24, overlap=overlap)), seen)
    for request_id, case in seen["case_of"].items():
        assert_matches(results[request_id], case, references)
    # The plain requests get what they get without any beam beside them.
    plain = [make_request(random_prompt(5, seed=30 + i), f"plain-{i}", **params) for i, params in enumerate(PLAIN)]
    alone = Engine(ours, tokenizer, EngineConfig(max_slots=24, overlap=overlap)).generate(plain)
    for result in alone:
        assert outcome(results[result.request_id]) == outcome(result)

    with_beams = [launched for launched in seen["launches"] if launched.beams is not None]
    assert len(with_beams) >= 8
    # Several beam requests of different widths in one batched operation.
    assert max(len(launched.beams.groups) for launched in with_beams) >= 3
    assert len(seen["batched"]) == len(seen["launches"]) and max(seen["batched"]) >= 3  # no row-by-row layout
    for launched in with_beams:
        # The candidates ride the sampler's one device→host copy: one host buffer holds both.
        assert launched.beams.candidates.untyped_storage().data_ptr() == launched.sampled.untyped_storage().data_ptr()
        assert launched.rows.facts.table is not None  # read as a batch
        assert launched.deferred == overlap  # overlap stays on with beams running
    assert sum(seen["ahead"]) >= (4 if overlap else 0) and (overlap or not any(seen["ahead"]))


@pytest.mark.parametrize("sources, copies", [
    ([0, 1, 2, 3], 0),  # every beam continues itself
    ([2, 0, 3, 1], 0),  # a permutation: slots change hands, nothing is copied
    ([0, 0, 0, 0], 3),  # the first step: beam 0's prompt for every beam
    ([1, 1, 3, 0], 1),
])
def test_a_beam_continues_its_source_on_its_slot_and_only_duplicates_copy(sources, copies):
    slots = [7, 3, 12, 5]
    held, made = continue_beams(slots, sources)
    assert sorted(held) == sorted(slots) and len(made) == copies  # the request's own slots, each once
    copied = {dst: src for src, dst in made}
    for beam, source in enumerate(sources):  # what each beam holds next is its source's cache
        assert copied.get(held[beam], held[beam]) == slots[source]
    assert not {src for src, _ in made} & {dst for _, dst in made}  # so the copies' order is free
