"""From BATCHED_ROWS running requests the runner lays a step out from its input batch's arrays (the
decode rows from one mask, their tokens fed from the device), below it row by row from the
sequences; the scheduler reads every step's tokens as a batch: stops by EOS, stop token ids and
length decided over arrays gathered at launch (service/engine/input_batch.py), alternatives taken
for the rows that asked. The array layout must give what the row-by-row one gives, with overlap on
and off, including rows whose sequence ended after their step launched."""

from __future__ import annotations

import pytest

import service.engine.layout as layout_module
from service.engine.core import EngineConfig, EngineCore
from tests.engine.conftest import assert_same_outputs, make_request, random_prompt


def run(model, eos: int, requests: list[dict], overlap: bool, cancel_at: dict[str, int] | None = None,
        batched: bool = True):
    """{request id: [(token, log-prob, finish reason or None, alternatives), ...]} and the steps laid out from
    the input batch's arrays. `batched`: False lays out every step row by row."""
    layout_module.BATCHED_ROWS = 1 if batched else 10**9  # the conftest puts it back
    core = EngineCore(model, eos, EngineConfig(max_slots=4, overlap=overlap))
    calls = []
    layout = core.runner.layout
    real = layout._batch
    layout._batch = lambda *args: (calls.append(layout), real(*args))[1]
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
        for request_id, _, token, logprob, reason, top in result.tokens:
            out.setdefault(request_id, []).append((token, logprob, reason, top))
        done.update(d.request_id for d in result.done)
        if pending and len(done) >= 1:
            core.submit([pending.pop(0)])
        if not pending and not core.has_work():
            assert core.cache.slots_used == 0
            return out, len(calls)
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
        assert batched > 10  # the array layout ran
        one_by_one, none = run(tiny_model, eos, plain, overlap, batched=False)
        assert none == 0
        assert_same_outputs(one_by_one, batch)
        # A neighbour asking for alternatives changes nothing of the others'.
        beside, _ = run(tiny_model, eos, plain + [dict(max_new_tokens=30, top_logprobs=2)], overlap)
        assert_same_outputs({k: v for k, v in beside.items() if k != "r5"}, batch)
        outcomes[overlap] = batch
    assert_same_outputs(outcomes[True], outcomes[False])
    first = outcomes[False]["r0"]
    assert [reason for *_, reason, _ in first] == [None] * where + ["eos_token"]  # ended at its EOS, not after
    ignoring = outcomes[False]["r1"]
    assert ignoring[where][0] == eos and len(ignoring) == where + 3 and ignoring[-1][2] == "length"


def test_stop_ids_and_alternatives_are_read_as_a_batch(tiny_model, eos):
    stop, where = eos  # no EOS in this engine: the token is a stop token id of r1 only
    mixed = [FIRST, dict(FIRST, stop_token_ids=[7, stop], prompt=0), dict(max_new_tokens=9, top_logprobs=3),
             dict(max_new_tokens=11, do_sample=True, seed=3, top_logprobs=1), dict(max_new_tokens=6, stop_token_ids=[5])]
    for overlap in (False, True):
        batch, batched = run(tiny_model, -1, mixed, overlap)
        assert batched > 10  # neither stop ids nor alternatives take a step off the array layout
        one_by_one, _ = run(tiny_model, -1, mixed, overlap, batched=False)
        assert_same_outputs(batch, one_by_one)
        assert [reason for *_, reason, _ in batch["r1"]] == [None] * where + ["eos_token"]
        assert len(batch["r0"]) == 12
        assert [entry[:2] for entry in batch["r0"][: where + 1]] == [entry[:2] for entry in batch["r1"]]
        assert all(len(top) == 3 and top[0][1] >= top[-1][1] for *_, top in batch["r2"])
        assert all(len(top) == 1 for *_, top in batch["r3"])
        assert all(top is None for entry in ("r0", "r1", "r4") for *_, top in batch[entry])


def test_a_row_ended_after_its_step_was_launched_gets_nothing(tiny_model, eos):
    """With overlap, the step after the one that drew a row's EOS is launched before the EOS is
    read: that row's second token must not reach anyone. The same for a cancelled row."""
    eos, where = eos
    plain = [FIRST, dict(max_new_tokens=12, ignore_eos=True), dict(max_new_tokens=20)]
    synchronous, _ = run(tiny_model, eos, plain, overlap=False, batched=False)
    overlapped, batched = run(tiny_model, eos, plain, overlap=True, cancel_at={"r2": 6})
    assert batched > 5
    assert len(synchronous["r0"]) == where + 1
    assert_same_outputs([overlapped["r0"], overlapped["r1"]], [synchronous["r0"], synchronous["r1"]])
    cancelled = overlapped["r2"]
    assert 0 < len(cancelled) < len(synchronous["r2"])
    assert_same_outputs(cancelled, synchronous["r2"][: len(cancelled)])
