"""The core's overlap (a step launched before the previous one's tokens are read) changes no
output: every request gets the tokens, log-probs, alternatives and finish reasons it gets with
overlap off, whatever it shares the engine with, as it arrives, finishes, is cancelled or packed.

On a CPU the device runs in the caller's thread, so overlap gains nothing here; the same code
runs on CUDA, where it is on by default (EngineConfig.overlap), and this is where its exactness
is proved.
"""

from __future__ import annotations

import math

import pytest

import service.engine.layout as layout_module
from service.engine.ngram_drafter import NgramSettings
from service.engine.scheduler import Scheduler
from service.engine.step_sampler import StepSampler
from tests.conftest import TINY
from tests.engine.conftest import assert_same_outputs, make_request, random_prompt

JSON_GRAMMAR = '%llguidance {}\nstart: "{\\"a\\": " /[0-9]{1,3}/ "}"'

# (arrives at step, prompt seed, prompt length, parameters): greedy and sampled rows, penalties
# and controls, several sequences per prompt, alternatives and prompt scores, stop tokens that
# end rows at steps only the sampled tokens decide, prompts longer than a prefill chunk.
MIXED = [
    (0, 1, 5, dict(max_new_tokens=12)),
    (0, 2, 9, dict(max_new_tokens=20, do_sample=True, seed=7, temperature=0.8, top_k=50)),
    (0, 3, 3, dict(max_new_tokens=15, do_sample=True, seed=8, top_p=0.9, num_return_sequences=3)),
    (1, 4, 14, dict(max_new_tokens=9, repetition_penalty=1.3, top_logprobs=3, prompt_logprobs=True)),
    (1, 5, 6, dict(max_new_tokens=25, do_sample=True, seed=9, stop_token_ids=tuple(range(0, TINY.vocab_size, 5)))),
    (2, 6, 40, dict(max_new_tokens=7, presence_penalty=0.5, frequency_penalty=0.4, no_repeat_ngram_size=2)),
    (3, 7, 4, dict(max_new_tokens=18, do_sample=True, seed=10, min_new_tokens=6, min_p=0.05,
                   stop_token_ids=tuple(range(1, TINY.vocab_size, 3)))),
    (3, 8, 11, dict(max_new_tokens=1)),
    (5, 9, 7, dict(max_new_tokens=14, logit_bias=((11, 5.0), (12, -3.0)), bad_words_ids=((13,), (14, 15)))),
    (6, 1, 5, dict(max_new_tokens=16)),  # the first prompt again: a reused prefix
    (8, 10, 70, dict(max_new_tokens=11, do_sample=True, seed=11, typical_p=0.9)),
    (9, 11, 3, dict(max_new_tokens=30, do_sample=True, seed=12, top_logprobs=2)),
    # Up to the context's end: a step launched past a row's last token would write past it.
    (2, 14, TINY.n_positions - 10, dict(max_new_tokens=10, do_sample=True, seed=14, no_repeat_ngram_size=3)),
]
BEAM = (2, 12, 6, dict(max_new_tokens=8, num_beams=3, num_return_sequences=2))
GRAMMAR = (4, 13, 5, dict(max_new_tokens=12, grammar=JSON_GRAMMAR, do_sample=True, seed=13))


def run(make_engine, entries, overlap: bool, cancel: dict[str, int] | None = None, paced: list | None = None,
        drafted: list | None = None, **config):
    """Every request's outcome (timings aside), and how many steps ran ahead of the host.
    `paced`: gets, per step, whether a step was in flight while a host-paced request ran;
    `drafted`: per launch, (whether it verified drafts, whether its read was deferred)."""
    engine = make_engine(overlap=overlap, **config)
    real_execute = engine.core.runner.execute

    def execute(plan, deferred):
        # A request that needs its last token on the host never steps before that token is read:
        # a beam, or a draft (a drafter without one this step decodes as a plain row).
        assert all(not seq.pending or (state.beam is None and not seq.draft)
                   for state in plan.decode if state.host_paced for seq in state.live)
        launched = real_execute(plan, deferred)
        if drafted is not None:
            drafted.append((bool(launched.rows.drafted), deferred))
        return launched

    engine.core.runner.execute = execute
    requests = {f"r{i}": (arrives, make_request(random_prompt(length, seed), f"r{i}", **params))
                for i, (arrives, seed, length, params) in enumerate(entries)}
    results, ahead = {}, 0
    for step in range(400):
        if arriving := [r for arrives, r in requests.values() if arrives == step]:
            engine.submit(arriving)
        for request_id, at in (cancel or {}).items():
            if at == step:
                engine.cancel(request_id)
        output = engine.step()
        assert not output.failed, output.failed
        scheduler = engine.core.scheduler  # its list, kept as requests come and go, is the real one
        assert scheduler.host_paced == [state for state in scheduler.running if state.host_paced]
        # What packing's shortcut (KVCache.packed) relies on: the slots in use are the live sequences'.
        live = sorted(seq.slot for state in scheduler.running for seq in state.live)
        assert len(live) == engine.cache.slots_used
        assert not engine.cache.packed or live == list(range(len(live)))
        # The slot table's lengths (the counters of the next draws, read by the batched layout).
        table = engine.core.runner.batch
        plain = [state for state in scheduler.running if state.beam is None]
        last_tokens = engine.core.runner.batch.last_tokens.tolist()
        for state in plain:
            for seq in state.live:
                assert table.lengths([seq.slot])[0] == len(seq.token_ids) + seq.pending
                if not seq.pending and len(seq.token_ids) > seq.prompt_length:  # what a decode feeds
                    assert last_tokens[seq.slot] == seq.token_ids[-1]
        # ...and the slots it says decode next: the scheduler's decode batch.
        if not any(state.beam is not None for state in scheduler.running):
            decoding = [seq.slot for state in plain if not state.prefilling and not exhausted(state) for seq in state.live]
            assert table.decoding(engine.cache.in_use) == sorted(decoding)
        results.update((f.request_id, outcome(f)) for f in output.finished)
        ahead += engine.core._launched is not None
        if paced is not None:
            paced.append(engine.core._launched is not None and bool(scheduler.host_paced))
        if len(results) == len(requests) and not engine.has_work():
            assert engine.cache.slots_used == 0  # nothing leaked
            return results, ahead
    raise AssertionError("the engine did not finish")


def exhausted(state) -> bool:
    """Its sequences (which advance together) drew their last token in a step whose tokens the
    host has not read: done by length, though not yet known to be."""
    seq = next((s for s in state.sequences if s.finish_reason is None), None)
    return seq is not None and seq.pending > 0 and len(seq.token_ids) + seq.pending - seq.prompt_length >= state.params.max_new_tokens


def outcome(finished) -> list:
    return [(s.token_ids, s.text, s.logprobs, s.finish_reason, s.score, s.top_logprobs) for s in finished.sequences] + [
        finished.prompt_logprobs, finished.seed]


@pytest.mark.parametrize("config", [
    dict(max_slots=6),  # fewer slots than requests: admissions as others finish, packing moves
    dict(max_slots=16, max_prefill_tokens=8),  # prompts in chunks beside decoding rows
    dict(max_slots=6, static_decode=True),  # the static (CUDA-graph) decode reads the device's tokens
    dict(max_slots=16, prefix_caching=False),
])
def test_overlap_changes_no_output(make_engine, config):
    synchronous, ahead_off = run(make_engine, MIXED, overlap=False, **config)
    overlapped, ahead_on = run(make_engine, MIXED, overlap=True, **config)
    assert ahead_off == 0 and ahead_on > 10  # it did run ahead
    assert_same_outputs(overlapped, synchronous)


def test_a_sequence_packed_while_its_last_token_is_in_flight_keeps_its_keys(make_engine):
    """Requests finishing one after another leave the last one alone in a high slot with its last
    token in flight: it is packed into a lower slot in a step that runs nothing. Its keys must
    move with it, or a later prompt reusing that prefix reads another sequence's keys."""
    cases = [(1, 12), (5, 20), (17, 16), (40, 9)]  # (prompt length, new tokens): finishing out of order
    outcomes = {}
    for overlap in (False, True):
        engine = make_engine(overlap=overlap, max_slots=len(cases), max_prefill_tokens=8)
        first = engine.generate([make_request(random_prompt(n, seed=n), max_new_tokens=new) for n, new in cases])
        again = [engine.generate([make_request(random_prompt(n, seed=n), max_new_tokens=new)])[0] for n, new in cases]
        outcomes[overlap] = [outcome(r) for r in first + again]
    assert outcomes[True] == outcomes[False]


def test_requests_that_need_the_hosts_tokens_keep_overlap_on_and_change_nothing(make_engine):
    """Beams and drafts need each token on the host before their next step (they sit out the steps
    launched before it is read), a grammar's matcher before its step's draw: overlap stays on for
    everyone, and every output is the synchronous one."""
    entries = MIXED[:6] + [BEAM, GRAMMAR]
    for config in (dict(max_slots=12), dict(max_slots=12, speculative=NgramSettings())):
        synchronous, _ = run(make_engine, entries, overlap=False, **config)
        paced = []
        overlapped, ahead = run(make_engine, entries, overlap=True, paced=paced, **config)
        assert_same_outputs(overlapped, synchronous)
        assert sum(paced) > 5  # steps in flight while they ran


def test_a_grammar_steps_every_step_its_draw_waiting_for_the_read(make_engine, monkeypatch):
    """A grammar's mask needs its last token only to draw: with overlap on, a constrained request
    never sits a step out; a step with its row queues the forwards and draws once the step before
    is read (StepSampler.draw), and every output is the synchronous one."""
    waited, sat_out = [], []
    real_draw, real_schedule = StepSampler.draw, Scheduler.schedule

    def draw(self, launched):
        waited.append(launched)
        return real_draw(self, launched)

    def schedule(self, *args, **options):
        plan = real_schedule(self, *args, **options)
        sat_out.extend(plan.sitting_out)
        return plan

    monkeypatch.setattr(StepSampler, "draw", draw)
    monkeypatch.setattr(Scheduler, "schedule", schedule)
    entries = MIXED[:4] + [GRAMMAR]
    synchronous, _ = run(make_engine, entries, overlap=False, max_slots=8)
    assert not waited
    overlapped, _ = run(make_engine, entries, overlap=True, max_slots=8)
    assert_same_outputs(overlapped, synchronous)
    assert len(waited) > 3 and not sat_out


def test_cancelled_requests_end_where_they_were_and_others_are_untouched(make_engine):
    cancel = {"r1": 4, "r2": 7, "r4": 3}
    # Without prefix caching: a cancelled request's cached keys change which prefix a later prompt
    # reuses, and a reused prefix is exact only to ~1e-5 in log-probs (docs/batch-invariance.md).
    synchronous, _ = run(make_engine, MIXED, overlap=False, max_slots=8, prefix_caching=False)
    overlapped, _ = run(make_engine, MIXED, overlap=True, cancel=cancel, max_slots=8, prefix_caching=False)
    for request_id, result in overlapped.items():
        if request_id not in cancel:
            assert_same_outputs(result, synchronous[request_id])
            continue
        for (tokens, *_, reason, _score, _top), (full, *_) in zip(result[:-2], synchronous[request_id][:-2]):
            assert reason in ("cancelled", "eos_token", "length")
            assert tokens == full[: len(tokens)]  # a prefix of what it would have written


def test_tokens_arrive_one_step_later_with_overlap(make_engine):
    """What overlap trades on a CPU: the host reads a step's tokens after launching the next."""
    counts = {}
    for overlap in (False, True):
        engine = make_engine(overlap=overlap, max_slots=2)
        engine.submit([make_request(random_prompt(4, seed=1), max_new_tokens=3)])
        counts[overlap] = [len(engine.step().events) for _ in range(4 + overlap)]
    assert counts[False] == [1, 1, 1, 0]
    assert counts[True] == [0, 1, 1, 1, 0]


def test_grammars_and_drafters_ride_the_batched_step(make_engine, monkeypatch):
    """A grammar's rows and a drafter's rows without a draft this step are laid out from the input
    batch beside plain rows and read there on their own: the outputs are the row-by-row layout's,
    with overlap on and off, and the batched layout ran while they did."""
    entries = MIXED[:6] + [GRAMMAR, (3, 15, 6, dict(max_new_tokens=14, speculate=True))]
    outcomes = {}
    for batched in (True, False):
        monkeypatch.setattr(layout_module, "BATCHED_ROWS", 1 if batched else 10**9)
        for overlap in (False, True):
            engine_steps = []
            real_batch = layout_module.StepLayout._batch

            def counting(self, plan, real_batch=real_batch):
                engine_steps.append(plan.host_paced)
                return real_batch(self, plan)

            monkeypatch.setattr(layout_module.StepLayout, "_batch", counting)
            outcomes[batched, overlap], _ = run(make_engine, entries, overlap, max_slots=12,
                                                speculative=NgramSettings())
            monkeypatch.setattr(layout_module.StepLayout, "_batch", real_batch)
            if batched:
                assert sum(1 for paced in engine_steps if paced) > 5  # laid out as a batch with them
            else:
                assert not engine_steps
    for layout_and_overlap in [(False, False), (True, True), (False, True)]:
        assert_same_outputs(outcomes[layout_and_overlap], outcomes[True, False], str(layout_and_overlap))


def test_drafted_steps_run_ahead_and_change_nothing(make_engine):
    """A step verifying drafts is launched before the previous step's tokens are read and read
    itself one step late: its drafters sit the next step out, its other rows feed their tokens
    from the device; every output is the synchronous one's."""
    eager = NgramSettings(weight_pass_rows=math.inf)  # every draft is worth its rows: many drafted steps
    repeating = [(0, 20 + i, 6, dict(max_new_tokens=80, speculate=True)) for i in range(3)]
    entries = MIXED[:6] + repeating
    synchronous, _ = run(make_engine, entries, overlap=False, max_slots=12, speculative=eager)
    engine_runs = []
    overlapped, _ = run(make_engine, entries, overlap=True, max_slots=12, speculative=eager, drafted=engine_runs)
    assert_same_outputs(overlapped, synchronous)
    assert sum(1 for drafted, deferred in engine_runs if drafted and deferred) > 5


def test_a_drafter_whose_drafts_do_not_pay_steps_every_step(make_engine, monkeypatch):
    """A drafter sits a step out (overlap) only to draft from its last token: one whose drafts do
    not pay at the batch's size (draft_policy.py) decodes as a plain row, fed from the device,
    every step, and its tokens are the synchronous ones, and those without speculation."""
    sat_out = []
    real_schedule = Scheduler.schedule

    def schedule(self, *args, **options):
        plan = real_schedule(self, *args, **options)
        sat_out.extend(plan.sitting_out)
        assert not plan.drafted
        return plan

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    stingy = NgramSettings(weight_pass_rows=1e-9)  # a draft token must be sure to stand: none is
    entries = MIXED[:6] + [(0, 20 + i, 6, dict(max_new_tokens=24, speculate=True)) for i in range(3)]
    plain, _ = run(make_engine, entries, overlap=True, max_slots=12)
    synchronous, _ = run(make_engine, entries, overlap=False, max_slots=12, speculative=stingy)
    paced = []
    overlapped, _ = run(make_engine, entries, overlap=True, max_slots=12, speculative=stingy, paced=paced)
    assert_same_outputs(overlapped, synchronous)
    assert_same_outputs(synchronous, plain)
    assert sum(paced) > 5 and not sat_out  # drafters ran, in flight, and none sat a step out
