"""The core reads a step whose rows need nothing of their own (no draft, stop token ids, grammar or
alternatives) as a batch: stops by EOS and length decided over arrays gathered from the per-slot
tables at launch (service/engine/slot_rows.py). It must give what the row-by-row read gives,
with overlap on and off, including rows whose sequence ended after their step was launched."""

from __future__ import annotations

import pytest

import service.engine.core as core_module
from service.engine.core import EngineConfig, EngineCore
from tests.engine.conftest import make_request, random_prompt


@pytest.fixture(autouse=True)
def batched_from_one_row(monkeypatch):
    """These tests' few rows read as a batch too (the core reads small steps row by row)."""
    monkeypatch.setattr(core_module, "BATCHED_READ_ROWS", 1)


def run(model, eos: int, requests: list[dict], overlap: bool, cancel_at: dict[str, int] | None = None):
    """{request id: [(token, log-prob, finish reason or None), ...]} and the steps read as a batch."""
    core = EngineCore(model, eos, EngineConfig(max_slots=4, overlap=overlap))
    batched = []
    read_as_batch = core._advance_batch
    core._advance_batch = lambda *args: (batched.append(1), read_as_batch(*args))[1]
    # `prompt`: the prompt of an earlier entry (default: its own)
    entries = [dict(params) for params in requests]
    prompts = [entry.pop("prompt", i) for i, entry in enumerate(entries)]
    pending = [make_request(random_prompt(4 + p, seed=p), f"r{i}", **entry)
               for i, (p, entry) in enumerate(zip(prompts, entries))]
    core.submit(pending[:3])  # the rest as slots free
    pending = pending[3:]
    out: dict[str, list] = {}
    done = set()
    for step in range(300):
        for request_id, at in (cancel_at or {}).items():
            if at == step:
                core.cancel(request_id)
        result = core.step()
        assert not result.failed
        for request_id, _, token, logprob, reason, _ in result.tokens:
            out.setdefault(request_id, []).append((token, logprob, reason))
        done.update(d.request_id for d in result.done)
        if pending and len(done) >= 1:
            core.submit([pending.pop(0)])
        if not pending and not core.has_work():
            assert core.cache.slots_used == 0
            return out, len(batched)
    raise AssertionError("the core did not finish")


FIRST = dict(max_new_tokens=12, do_sample=True, seed=1)  # sampled: tokens that vary


@pytest.fixture
def eos(tiny_model) -> tuple[int, int]:
    """(token, where): a token the first request's run writes first at `where` >= 2, made EOS."""
    out, _ = run(tiny_model, -1, [FIRST], overlap=False)
    tokens = [token for token, *_ in out["r0"]]
    where = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    return tokens[where], where


def test_eos_and_length_end_rows_as_one_by_one(tiny_model, eos):
    eos, where = eos
    # r1: r0's prompt and seed, ignoring EOS: it writes r0's EOS and goes on.
    plain = [FIRST, dict(FIRST, max_new_tokens=where + 3, ignore_eos=True, prompt=0), dict(max_new_tokens=7),
             dict(max_new_tokens=11, do_sample=True, seed=3), dict(max_new_tokens=5)]
    outcomes = {}
    for overlap in (False, True):
        batch, batched = run(tiny_model, eos, plain, overlap)
        assert batched > 10  # the batched read ran
        # A neighbour asking for alternatives sends every step through the row-by-row read.
        one_by_one, batched_beside = run(tiny_model, eos, plain + [dict(max_new_tokens=30, top_logprobs=2)], overlap)
        assert batched_beside < batched
        assert {k: v for k, v in one_by_one.items() if k != "r5"} == batch
        outcomes[overlap] = batch
    assert outcomes[True] == outcomes[False]
    first = outcomes[False]["r0"]
    assert [reason for *_, reason in first] == [None] * where + ["eos_token"]  # ended at its EOS, not after
    ignoring = outcomes[False]["r1"]
    assert ignoring[where][0] == eos and len(ignoring) == where + 3 and ignoring[-1][2] == "length"


def test_a_row_ended_after_its_step_was_launched_gets_nothing(tiny_model, eos):
    """With overlap, the step after the one that drew a row's EOS is launched before the EOS is
    read: that row's second token must not reach anyone. The same for a cancelled row."""
    eos, where = eos
    plain = [FIRST, dict(max_new_tokens=12, ignore_eos=True), dict(max_new_tokens=20)]
    synchronous, _ = run(tiny_model, eos, plain, overlap=False)
    overlapped, batched = run(tiny_model, eos, plain, overlap=True, cancel_at={"r2": 6})
    assert batched > 5
    assert len(synchronous["r0"]) == where + 1
    assert overlapped["r0"] == synchronous["r0"] and overlapped["r1"] == synchronous["r1"]
    cancelled = overlapped["r2"]
    assert 0 < len(cancelled) < len(synchronous["r2"])
    assert cancelled == synchronous["r2"][: len(cancelled)]
