"""The engine loop: a background thread feeding asyncio queues, cancellation, shutdown, failures.

Every wait is bounded (WAIT seconds), so a broken loop fails a test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from service.loop import EngineLoop
from service.requests import (
    EngineStopped,
    FinishedRequest,
    QueueFull,
    RequestFailed,
    StepStats,
    TokenEvent,
)
from tests.engine.conftest import hf_generate, make_request, random_prompt

WAIT = 60.0


async def collect(queue: asyncio.Queue) -> tuple[list[TokenEvent], FinishedRequest | RequestFailed]:
    events = []
    while True:
        item = await asyncio.wait_for(queue.get(), WAIT)
        if isinstance(item, (FinishedRequest, RequestFailed)):
            return events, item
        events.append(item)


async def running_request(loop: EngineLoop, request) -> asyncio.Queue:
    """Submit one request and wait until it has produced its first token."""
    [queue] = loop.submit([request])
    assert isinstance(await asyncio.wait_for(queue.get(), WAIT), TokenEvent)
    return queue


def run(coroutine_function, *args):
    return asyncio.run(coroutine_function(*args))


def test_requests_stream_through_the_loop_and_match_generate(make_engine, hf_model):
    prompts = [random_prompt(n, seed=n) for n in (4, 9, 13)]
    stats: list[StepStats] = []
    steps_thread = []

    def on_step(step: StepStats) -> None:
        stats.append(step)
        steps_thread.append(threading.current_thread().name)

    loop = EngineLoop(make_engine(), on_step=on_step)

    async def main():
        loop.start()
        queues = loop.submit([make_request(p, max_new_tokens=6) for p in prompts])
        outputs = await asyncio.gather(*(collect(q) for q in queues))
        await loop.stop()
        return outputs

    outputs = run(main)
    for prompt, (events, finished) in zip(prompts, outputs):
        assert finished.sequences[0].token_ids == hf_generate(hf_model, prompt, 6)
        assert [e.token_id for e in events] == finished.sequences[0].token_ids
    assert set(steps_thread) == {"engine-loop"}  # the model never ran on the event loop
    assert stats[0].prefill_tokens == sum(len(p) for p in prompts)
    assert sum(s.batch_size for s in stats) == 3 * 6
    assert stats[-1].kv_slots_used == 0 and stats[-1].running == 0
    assert not loop.running


def test_cancel_from_the_event_loop_frees_the_slots(make_engine):
    engine = make_engine()
    loop = EngineLoop(engine)

    async def main():
        loop.start()
        request = make_request([1, 2, 3], request_id="c", max_new_tokens=100, do_sample=True,
                               num_return_sequences=2)
        queue = await running_request(loop, request)
        loop.cancel("c")
        _, finished = await collect(queue)
        await loop.stop()
        return finished

    finished = run(main)
    assert [s.finish_reason for s in finished.sequences] == ["cancelled", "cancelled"]
    assert all(len(s.token_ids) < 100 for s in finished.sequences)
    assert engine.cache.slots_used == 0


def test_shutdown_drains_in_flight_requests_and_refuses_new_ones(make_engine):
    loop = EngineLoop(make_engine(max_slots=2))

    async def main():
        loop.start()
        queues = loop.submit([make_request([7] * n, max_new_tokens=15) for n in (1, 2, 3)])
        stopping = asyncio.ensure_future(loop.stop())  # drain: everything submitted finishes
        outputs = await asyncio.gather(*(collect(q) for q in queues))
        await asyncio.wait_for(stopping, WAIT)
        with pytest.raises(EngineStopped):
            loop.submit([make_request([1], max_new_tokens=1)])
        return outputs

    outputs = run(main)
    assert [f.sequences[0].finish_reason for _, f in outputs] == ["length"] * 3
    assert not loop.running


def test_shutdown_without_drain_cancels_in_flight_requests(make_engine):
    engine = make_engine()
    loop = EngineLoop(engine)

    async def main():
        loop.start()
        queue = await running_request(loop, make_request([1, 2], max_new_tokens=100))
        await loop.stop(drain=False)
        return await collect(queue)

    _, finished = run(main)
    assert finished.sequences[0].finish_reason == "cancelled"
    assert engine.cache.slots_used == 0


def test_queue_full_is_raised_to_the_caller_and_leaves_nothing_behind(make_engine):
    loop = EngineLoop(make_engine(max_waiting=1))  # not started: nothing leaves the queue

    async def main():
        loop.submit([make_request([1], request_id="a", max_new_tokens=1)])
        with pytest.raises(QueueFull):
            loop.submit([make_request([2], request_id="b", max_new_tokens=1)])
        with pytest.raises(ValueError):
            loop.submit([make_request([], request_id="c")])
        return set(loop._routes)

    assert run(main) == {"a"}


def test_a_failed_step_fails_its_requests_and_the_loop_serves_on(make_engine, hf_model):
    engine = make_engine()
    real_run = engine._run
    calls = {"n": 0}

    def flaky_run(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real_run(*args)

    engine._run = flaky_run
    loop = EngineLoop(engine)

    async def main():
        loop.start()
        [doomed] = loop.submit([make_request([1, 2], max_new_tokens=10)])
        _, failed = await collect(doomed)
        [healthy] = loop.submit([make_request([3, 4], max_new_tokens=4)])
        result = await collect(healthy)
        await loop.stop()
        return failed, result

    failed, (_, finished) = run(main)
    assert isinstance(failed, RequestFailed) and "device lost" in failed.message
    assert finished.sequences[0].token_ids == hf_generate(hf_model, [3, 4], 4)
    assert engine.cache.slots_used == 0
