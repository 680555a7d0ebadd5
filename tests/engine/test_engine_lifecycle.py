"""Requests through the engine's life: admission limits, submissions, stops, cancellation, slots."""

from __future__ import annotations

import pytest

from service.engine.types import QueueFull
from tests.engine.conftest import drive, hf_generate, make_request, random_prompt, run_until_idle
from weights.tokenizer import GPT2Tokenizer


def test_several_prompts_of_one_submission_are_prefilled_together(make_engine, hf_model):
    engine = make_engine(max_slots=4, max_prefill_tokens=20, overlap=False)  # counts steps of the synchronous core
    prompts = [random_prompt(n, seed=n) for n in (3, 11, 6)]
    engine.submit([make_request(p, max_new_tokens=5, request_id=f"part-{i}") for i, p in enumerate(prompts)])
    first = engine.step()
    assert first.stats.prefill_tokens == sum(len(p) for p in prompts)
    assert sorted(e.request_id for e in first.events) == ["part-0", "part-1", "part-2"]
    results = {f.request_id: f for f in run_until_idle(engine)}
    for i, prompt in enumerate(prompts):
        assert results[f"part-{i}"].sequences[0].token_ids == hf_generate(hf_model, prompt, 5)


def test_prefill_budget_is_prompt_tokens_per_step(make_engine, hf_model):
    engine = make_engine(max_slots=4, max_prefill_tokens=20, overlap=False)  # counts steps of the synchronous core
    prompts = [random_prompt(15, seed=1), random_prompt(15, seed=2)]
    engine.submit([make_request(prompts[0], request_id="a", max_new_tokens=3)])
    engine.submit([make_request(prompts[1], request_id="b", max_new_tokens=3)])
    first = engine.step()
    # All of a; b's 15 do not fit in the 5 left, and a chunk never takes what another prompt
    # left (where b's chunks end would depend on a): b waits, then comes whole.
    assert first.stats.prefill_tokens == 15
    assert [e.request_id for e in first.events] == ["a"]
    assert engine.step().stats.prefill_tokens == 15
    results = {f.request_id: f for f in run_until_idle(engine)}
    for request_id, prompt in zip("ab", prompts):
        assert results[request_id].sequences[0].token_ids == hf_generate(hf_model, prompt, 3)


def test_a_submission_larger_than_the_cache_runs_in_parts(make_engine, hf_model):
    engine = make_engine(max_slots=2)
    prompts = [random_prompt(4 + i, seed=i) for i in range(5)]
    results = engine.generate([make_request(p, max_new_tokens=3) for p in prompts])
    for prompt, result in zip(prompts, results):
        assert result.sequences[0].token_ids == hf_generate(hf_model, prompt, 3)


def test_tokens_stream_as_events_that_add_up_to_the_result(make_engine):
    engine = make_engine()
    engine.submit([make_request(random_prompt(5, seed=5), request_id="s", max_new_tokens=9, do_sample=True, seed=1)])
    events, finished = [], []
    while engine.has_work():
        output = engine.step()
        events += output.events
        finished += output.finished
    [result] = finished
    sequence = result.sequences[0]
    assert [e.token_id for e in events] == sequence.token_ids
    assert "".join(e.text for e in events) == sequence.text
    assert [e.logprob for e in events] == sequence.logprobs
    assert [e.time for e in events] == sequence.token_times
    assert sequence.token_times == sorted(sequence.token_times)


def test_stop_string_split_across_tokens_ends_the_sequence_before_it(make_engine, tokenizer):
    prompt = random_prompt(6, seed=6)
    params = dict(max_new_tokens=30, do_sample=True, seed=99)
    [free] = make_engine().generate([make_request(prompt, **params)])
    tokens = free.sequences[0].token_ids
    pieces = [tokenizer.decode([t]) for t in tokens]
    # A stop string made of the end of one token and the start of the next.
    i = next(i for i in range(5, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    full = tokenizer.decode(tokens)
    completes_at = next(n for n in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:n]))

    engine = make_engine()
    engine.submit([make_request(prompt, request_id="stop", stop=("never-there", stop), **params)])
    events, finished = [], []
    while engine.has_work():
        output = engine.step()
        events += output.events
        finished += output.finished
    sequence = finished[0].sequences[0]
    assert sequence.finish_reason == "stop_sequence"
    assert sequence.text == full[: full.index(stop)]
    assert sequence.token_ids == tokens[:completes_at]
    released = ""
    for event in events:  # at no point did a client see any of the stop string
        released += event.text
        assert sequence.text.startswith(released)
    assert engine.cache.slots_used == 0


def test_eos_ends_a_sequence_unless_ignored(tiny_model_dir, make_engine, hf_model):
    prompt = random_prompt(7, seed=7)
    reference = hf_generate(hf_model, prompt, 12)
    eos = reference[5]  # a token the model will produce: make it the end-of-sequence token
    stops_at = reference.index(eos)
    tokenizer = GPT2Tokenizer.from_dir(tiny_model_dir)
    tokenizer.eos_token_id = eos
    engine = make_engine(tokenizer=tokenizer)
    stopped, ignored = engine.generate(
        [make_request(prompt, max_new_tokens=12), make_request(prompt, max_new_tokens=12, ignore_eos=True)]
    )
    assert stopped.sequences[0].token_ids == hf_generate(hf_model, prompt, 12, eos_token_id=eos)
    assert stopped.sequences[0].token_ids == reference[: stops_at + 1]
    assert stopped.sequences[0].finish_reason == "eos_token"
    assert ignored.sequences[0].token_ids == reference
    assert ignored.sequences[0].finish_reason == "length"


def test_cancelling_a_running_request_frees_its_slots_at_the_next_step(make_engine, hf_model):
    engine = make_engine(max_slots=4, overlap=False)  # counts steps of the synchronous core
    keep = make_request(random_prompt(5, seed=1), request_id="keep", max_new_tokens=10)
    drop = make_request(random_prompt(5, seed=2), request_id="drop", max_new_tokens=50,
                        do_sample=True, num_return_sequences=2)
    engine.submit([keep, drop])
    drive(engine, 3)
    assert engine.cache.slots_used == 3
    engine.cancel("drop")
    output = engine.step()
    [cancelled] = output.finished
    assert cancelled.request_id == "drop"
    assert [s.finish_reason for s in cancelled.sequences] == ["cancelled", "cancelled"]
    assert all(len(s.token_ids) == 3 for s in cancelled.sequences)  # what it had produced
    assert engine.cache.slots_used == 1
    [kept] = run_until_idle(engine)
    assert kept.sequences[0].token_ids == hf_generate(hf_model, keep.prompt_ids, 10)
    assert engine.cache.slots_used == 0


def test_cancelling_a_waiting_request_removes_it_without_running_it(make_engine):
    engine = make_engine(max_slots=1)
    engine.submit([make_request(random_prompt(5, seed=1), request_id="first", max_new_tokens=6)])
    engine.submit([make_request(random_prompt(5, seed=2), request_id="queued", max_new_tokens=6)])
    engine.step()
    assert engine.scheduler.waiting.count == 1
    engine.cancel("queued")
    output = engine.step()
    assert [f.request_id for f in output.finished] == ["queued"]
    assert output.finished[0].sequences[0].finish_reason == "cancelled"
    assert output.finished[0].first_token_seconds is None
    assert engine.scheduler.waiting.count == 0
    assert [f.request_id for f in run_until_idle(engine)] == ["first"]


def test_finished_sequences_free_their_slots_as_they_finish(make_engine):
    engine = make_engine(max_slots=3, overlap=False)  # counts steps of the synchronous core
    engine.submit([make_request(random_prompt(4, seed=n), max_new_tokens=n) for n in (1, 3, 5)])
    used = [engine.step().stats.kv_slots_used for _ in range(5)]
    assert used == [2, 2, 1, 1, 0]


def test_queue_limit_raises_queue_full_and_queues_nothing(make_engine):
    engine = make_engine(max_slots=1, max_waiting=2)
    engine.submit([make_request([1, 2], max_new_tokens=2), make_request([3], max_new_tokens=2)])
    with pytest.raises(QueueFull):
        engine.submit([make_request([4], max_new_tokens=2)])
    assert engine.scheduler.waiting.count == 2
    run_until_idle(engine)
    engine.submit([make_request([4], max_new_tokens=2)])  # room again


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([1] * 100, dict(max_new_tokens=29), "exceeds the maximum sequence length 128"),
        ([], dict(), "prompt is empty"),
        ([1], dict(max_new_tokens=0), "max_new_tokens"),
        ([1], dict(num_beams=2, do_sample=True), "beam search with sampling"),
        ([1], dict(num_beams=2, num_return_sequences=3), "must not exceed num_beams"),
        ([1], dict(num_return_sequences=2), "do_sample"),
        ([1], dict(do_sample=True, temperature=0.0), "temperature"),
        ([1], dict(stop=("",)), "stop strings must not be empty"),
        ([1], dict(num_beams=9), "9 sequences at once"),
    ],
)
def test_requests_that_can_never_run_are_refused_with_a_reason(make_engine, prompt, params, message):
    engine = make_engine(max_len=128)
    with pytest.raises(ValueError, match=message):
        engine.submit([make_request([5, 6], max_new_tokens=2), make_request(prompt, **params)])
    assert not engine.has_work()  # neither prompt of the refused submission was queued
    assert engine.cache.slots_used == 0


def test_request_ids_must_be_unique_while_active(make_engine):
    engine = make_engine()
    engine.submit([make_request([1], request_id="same", max_new_tokens=2)])
    with pytest.raises(ValueError, match="unique"):
        engine.submit([make_request([2], request_id="same", max_new_tokens=2)])
    run_until_idle(engine)
    engine.submit([make_request([2], request_id="same", max_new_tokens=2)])  # finished: reusable


def test_timings_are_ordered_and_a_queued_request_waits_longer(make_engine):
    engine = make_engine(max_slots=1)
    first, second = make_request([1, 2], max_new_tokens=4), make_request([3, 4], max_new_tokens=4)
    engine.submit([first])
    engine.submit([second])
    results = {f.request_id: f for f in run_until_idle(engine)}
    a, b = results[first.request_id], results[second.request_id]
    for result in (a, b):
        assert 0 <= result.queue_seconds <= result.first_token_seconds <= result.total_seconds
    # The second waited for the only slot: it was scheduled after the first's last token.
    assert second.arrival_time + b.queue_seconds >= a.sequences[0].token_times[-1]
    assert b.sequences[0].token_times[0] > a.sequences[0].token_times[-1]


def test_a_failure_while_admitting_fails_the_step_and_leaks_no_slot(make_engine, hf_model):
    engine = make_engine(max_slots=2)
    real_write = engine.input_batch.write_device
    calls = {"n": 0}

    def failing_write(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("cannot write parameters")
        real_write(*args)

    engine.input_batch.write_device = failing_write
    engine.submit([make_request([1, 2], request_id=f"r{i}", max_new_tokens=3) for i in range(3)])
    output = engine.step()
    # Writing an admitted sequence into the runner's batch failed: the step's requests fail, the
    # one no slot was left for waits its turn.
    assert sorted(f.request_id for f in output.failed) == ["r0", "r1"]
    assert "cannot write parameters" in output.failed[0].message
    assert engine.cache.slots_used == 0 and engine.scheduler.waiting.count == 1
    [r2] = run_until_idle(engine)
    assert r2.request_id == "r2" and r2.sequences[0].token_ids == hf_generate(hf_model, [1, 2], 3)
    [after] = engine.generate([make_request([5, 6], max_new_tokens=3)])  # still serving
    assert after.sequences[0].token_ids == hf_generate(hf_model, [5, 6], 3)


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(make_engine, hf_model):
    engine = make_engine()
    real_run = engine.core.runner._run
    calls = {"n": 0}

    def flaky_run(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real_run(*args)

    engine.core.runner._run = flaky_run
    engine.submit([make_request([1, 2], request_id="doomed", max_new_tokens=10)])
    engine.step()
    failed = engine.step().failed
    assert [f.request_id for f in failed] == ["doomed"] and "device lost" in failed[0].message
    assert engine.cache.slots_used == 0
    [healthy] = engine.generate([make_request([3, 4], max_new_tokens=4)])
    assert healthy.sequences[0].token_ids == hf_generate(hf_model, [3, 4], 4)
