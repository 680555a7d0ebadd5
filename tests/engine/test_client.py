"""The engine core in its own process behind EngineClient: streaming, cancellation, admission,
shutdown, and a core that dies.

Every wait is bounded (WAIT seconds), so a broken client fails a test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from service.http.client import EngineClient
from service.http.core_link import CoreLink, RunDir
from service.engine.core import EngineConfig
from service.engine.process import CoreProcessConfig
from service.engine.protocol import CoreOutput
from service.engine.types import (
    CoreStep,
    EngineStopped,
    FinishedRequest,
    QueueFull,
    RequestFailed,
    StepStats,
    StepTokens,
    TokenEvent,
)
from tests.conftest import TINY
from tests.engine.conftest import hf_generate, make_request, random_prompt

WAIT = 60.0


@pytest.fixture
def make_client(tiny_model_dir, tokenizer):
    def make(on_step=None, max_in_flight=None, link=None, stream_interval=1, model_dir=tiny_model_dir,
             **engine) -> EngineClient:
        engine_config = EngineConfig(**{"max_slots": 8, "max_len": TINY.n_positions, **engine})
        config = CoreProcessConfig(model_dir, "cpu", "float32", 1, engine_config, tokenizer.eos_token_id)
        return EngineClient(config, tokenizer, on_step=on_step, max_in_flight=max_in_flight, link=link,
                            stream_interval=stream_interval)

    return make


async def collect(queue: asyncio.Queue) -> tuple[list[TokenEvent], FinishedRequest | RequestFailed]:
    events = []
    while True:
        item = await asyncio.wait_for(queue.get(), WAIT)
        if isinstance(item, (FinishedRequest, RequestFailed)):
            return events, item
        events.append(item)


async def running_request(client: EngineClient, request) -> asyncio.Queue:
    """Submit one request and wait until it has produced its first token."""
    [queue] = client.submit([request])
    assert isinstance(await asyncio.wait_for(queue.get(), WAIT), TokenEvent)
    return queue


async def idle_stats(client: EngineClient) -> StepStats:
    """The stats of the core's step after a fresh one-token request: what is still held then."""
    [queue] = client.submit([make_request([9], max_new_tokens=1)])
    await collect(queue)
    return client.last_stats


def run(coroutine_function, *args):
    return asyncio.run(asyncio.wait_for(coroutine_function(*args), 3 * WAIT))


def test_requests_stream_from_the_core_process_and_match_generate(make_client, hf_model):
    prompts = [random_prompt(n, seed=n) for n in (4, 9, 13)]
    stats: list[StepStats] = []
    client = make_client(on_step=stats.append)

    async def main():
        await client.start()
        core_pid = client._core.pid
        queues = client.submit([make_request(p, max_new_tokens=6) for p in prompts])
        outputs = await asyncio.gather(*(collect(q) for q in queues))
        await client.stop()
        return core_pid, outputs

    core_pid, outputs = run(main)
    assert core_pid != os.getpid()  # the model ran in its own process
    for prompt, (events, finished) in zip(prompts, outputs):
        assert finished.sequences[0].token_ids == hf_generate(hf_model, prompt, 6)
        assert [e.token_id for e in events] == finished.sequences[0].token_ids
        assert "".join(e.text for e in events) == finished.sequences[0].text
    assert stats[0].prefill_tokens == sum(len(p) for p in prompts)
    assert sum(s.batch_size for s in stats) == 3 * 6
    assert stats[-1].kv_slots_used == 0 and stats[-1].running == 0
    assert not client.running


def test_a_sink_takes_what_it_accepts_and_the_queue_the_rest_in_order(make_client, caplog):
    """EngineClient.hand_off, as an event stream uses it: the sink writes tokens itself while the
    stream waits on an empty queue; a token it declines (or fails on), the last token and the
    result come through the queue, and nothing is lost or reordered."""
    client = make_client()
    request = make_request(random_prompt(5, seed=3), max_new_tokens=12)
    offered, taken, order = [], [], []  # order: as the client would see them written

    def sink(events: list[TokenEvent]) -> bool:
        [event] = events  # with no stream interval, one token per delivery
        offered.append(event)
        if len(offered) == 3:
            return False
        if len(offered) == 6:
            raise RuntimeError("a sink's bug")
        taken.append(event)
        order.append(event)
        return True

    async def main():
        await client.start()
        [queue] = client.submit([request])
        finished = None
        while finished is None:
            client.hand_off(request.request_id, sink)
            items = [await asyncio.wait_for(queue.get(), WAIT)]
            client.take_back(request.request_id)
            while not queue.empty():
                items.append(queue.get_nowait())
            order.extend(item for item in items if isinstance(item, TokenEvent))
            finished = next((item for item in items if isinstance(item, FinishedRequest)), None)
        await client.stop()
        return finished

    finished = run(main)
    assert [e.token_id for e in order] == finished.sequences[0].token_ids
    assert len(taken) >= 4 and offered[2] not in taken and offered[5] not in taken  # declined, then failed
    assert order[-1] not in offered  # the last token goes with the result
    assert "a token sink failed" in caplog.text


def core_output(request_id: str, token_id: int) -> CoreOutput:
    """A step that brings one token of one request."""
    stats = StepStats(batch_size=1, prefill_tokens=0, decode_tokens=1, running=1, waiting=0, kv_slots_used=1,
                      kv_slots_total=8, step_seconds=0.0)
    return CoreOutput(CoreStep(StepTokens([request_id], [0], [token_id], [-1.0]), [], [], [], stats))


def test_a_step_is_delivered_tokens_first_and_a_declining_sink_is_let_go(make_client, tokenizer):
    """Driven step by step, as the reader callback would, with no core: the sink writes a step's
    tokens before its stats reach metrics; once the sink declines a token it is offered nothing
    more (a later token it wrote would reach the client before the declined one, which waits in
    the queue), until the stream hands off again."""
    seen = []  # what happened, in order
    client = make_client(on_step=lambda stats: seen.append("stats"))
    client._core.send = lambda message: None  # no core to tell
    request = make_request([1, 2], max_new_tokens=10, ignore_eos=True)
    words = tokenizer.encode(" one two three four")
    accept = True

    def sink(events: list[TokenEvent]) -> bool:
        seen.append(("offered", [e.token_id for e in events]))
        return accept

    async def main():
        nonlocal accept
        client._reader = asyncio.get_running_loop().create_future()  # reading, as start() leaves it
        [queue] = client.submit([request])
        client.hand_off(request.request_id, sink)
        client._take_step(core_output(request.request_id, words[0]))
        accept = False
        client._take_step(core_output(request.request_id, words[1]))  # declined: queued
        client._take_step(core_output(request.request_id, words[2]))  # read in the same callback
        assert seen == [("offered", [words[0]]), "stats", ("offered", [words[1]]), "stats", "stats"]
        assert [queue.get_nowait().token_id for _ in range(2)] == words[1:3]
        accept = True
        client.hand_off(request.request_id, sink)
        client._take_step(core_output(request.request_id, words[3]))
        assert seen[-2:] == [("offered", [words[3]]), "stats"] and queue.empty()

    run(main)


def test_a_stream_interval_delivers_tokens_in_groups_first_and_last_at_once(make_client):
    """--stream-interval 4: the first token alone (the time to first token is not traded), then
    groups of 4 in one delivery each; the tokens held when the request ends go with its last one
    and its result, through the queue. Nothing lost or reordered."""
    client = make_client(stream_interval=4)
    request = make_request(random_prompt(5, seed=3), max_new_tokens=13, ignore_eos=True)
    deliveries = []

    def sink(events: list[TokenEvent]) -> bool:
        deliveries.append(events)
        return True

    async def main():
        await client.start()
        [queue] = client.submit([request])
        client.hand_off(request.request_id, sink)
        events, finished = await collect(queue)
        await client.stop()
        return events, finished

    queued, finished = run(main)
    assert [len(d) for d in deliveries] == [1, 4, 4]  # tokens 1, 2-5, 6-9
    assert len(queued) == 4  # 10-12 held, then 13, the last, with the result
    tokens = [e.token_id for d in deliveries for e in d] + [e.token_id for e in queued]
    assert tokens == finished.sequences[0].token_ids and len(tokens) == 13


def test_a_stream_interval_keeps_text_and_stops_and_a_whole_answer_gets_its_result_alone(make_client, tokenizer):
    client = make_client(stream_interval=3)
    prompt = random_prompt(5, seed=3)

    async def main():
        await client.start()
        [queue] = client.submit([make_request(prompt, max_new_tokens=40, ignore_eos=True)])
        full = await collect(queue)
        stop = full[1].sequences[0].text[5:8]  # a stop string the output is sure to contain
        [stopped, two, quiet] = client.submit([
            make_request(prompt, max_new_tokens=40, ignore_eos=True, stop=(stop,)),
            make_request(prompt, max_new_tokens=11, do_sample=True, num_return_sequences=2, seed=5),
        ]) + client.submit([make_request(prompt, max_new_tokens=9, ignore_eos=True)], token_events=False)
        outputs = await asyncio.gather(*(collect(q) for q in (stopped, two, quiet)))
        after = await idle_stats(client)
        await client.stop()
        return full, outputs, stop, after

    full, (stopped, two, quiet), stop, after = run(main)
    for events, finished in (full, stopped, two):
        for index, seq in enumerate(finished.sequences):
            mine = [e for e in events if e.sequence_index == index]
            assert [e.token_id for e in mine] == seq.token_ids
            assert "".join(e.text for e in mine) == seq.text
    text = full[1].sequences[0].text
    assert stopped[1].sequences[0].text == text[: text.index(stop)]
    assert stopped[1].sequences[0].finish_reason == "stop_sequence"
    assert quiet[0] == [] and quiet[1].sequences[0].token_ids == full[1].sequences[0].token_ids[:9]
    assert after.kv_slots_used == 0 and after.running == 0 and client.in_flight == 0


def test_tokens_a_stream_interval_holds_reach_the_client_before_the_failure(make_client):
    steps = []
    client = make_client(on_step=steps.append, stream_interval=1000)

    async def main():
        await client.start()
        queue = await running_request(client, make_request([1, 2], max_new_tokens=100, ignore_eos=True))
        seen = len(steps)
        while len(steps) < seen + 5:
            await asyncio.sleep(0.01)
        assert queue.empty()  # held
        os.kill(client._core.pid, signal.SIGKILL)
        result = await collect(queue)
        await client.stop()
        return result

    events, failed = run(main)
    assert isinstance(failed, RequestFailed) and "died" in failed.message
    assert len(events) >= 5  # the tokens generated after the first, held until then


def test_cancel_finishes_at_once_and_frees_the_core_slots(make_client):
    client = make_client()

    async def main():
        await client.start()
        request = make_request([1, 2, 3], request_id="c", max_new_tokens=100, do_sample=True,
                               num_return_sequences=2)
        queue = await running_request(client, request)
        finished = client.cancel("c")
        assert client.cancel("c") is None  # once only
        after = await idle_stats(client)
        await client.stop()
        return finished, queue, after

    finished, queue, after = run(main)
    assert [s.finish_reason for s in finished.sequences] == ["cancelled", "cancelled"]
    assert all(len(s.token_ids) < 100 for s in finished.sequences)
    assert after.kv_slots_used == 0 and after.running == 0
    while not queue.empty():  # whatever reached the queue before the cancel is tokens only
        assert isinstance(queue.get_nowait(), TokenEvent)


def test_a_stop_string_ends_the_request_and_aborts_it_in_the_core(make_client, tokenizer):
    client = make_client()
    prompt = random_prompt(5, seed=3)

    async def main():
        await client.start()
        [queue] = client.submit([make_request(prompt, max_new_tokens=40, ignore_eos=True)])
        _, full = await collect(queue)
        stop = full.sequences[0].text[5:8]  # a stop string the output is sure to contain
        [queue] = client.submit([make_request(prompt, max_new_tokens=40, ignore_eos=True, stop=(stop,))])
        _, stopped = await collect(queue)
        after = await idle_stats(client)
        await client.stop()
        return full, stopped, stop, after

    full, stopped, stop, after = run(main)
    text = full.sequences[0].text
    assert stopped.sequences[0].finish_reason == "stop_sequence"
    assert stopped.sequences[0].text == text[: text.index(stop)]
    assert len(stopped.sequences[0].token_ids) < 40
    assert after.kv_slots_used == 0 and after.running == 0


def test_shutdown_drains_in_flight_requests_and_refuses_new_ones(make_client):
    client = make_client(max_slots=2)

    async def main():
        await client.start()
        queues = client.submit([make_request([7] * n, max_new_tokens=15) for n in (1, 2, 3)])
        stopping = asyncio.ensure_future(client.stop())  # drain: everything submitted finishes
        outputs = await asyncio.gather(*(collect(q) for q in queues))
        await asyncio.wait_for(stopping, WAIT)
        with pytest.raises(EngineStopped):
            client.submit([make_request([1], max_new_tokens=1)])
        return outputs

    outputs = run(main)
    assert [f.sequences[0].finish_reason for _, f in outputs] == ["length"] * 3
    assert not client.running


def test_shutdown_without_drain_cancels_in_flight_requests(make_client):
    client = make_client()

    async def main():
        await client.start()
        queue = await running_request(client, make_request([1, 2], max_new_tokens=100))
        await client.stop(drain=False)
        return await collect(queue)

    _, finished = run(main)
    assert finished.sequences[0].finish_reason == "cancelled"


def test_admission_counts_requests_in_flight_and_refuses_at_once(make_client):
    client = make_client(max_in_flight=2)

    async def main():
        await client.start()
        client.submit([make_request([1], max_new_tokens=50, ignore_eos=True) for _ in range(2)])
        with pytest.raises(QueueFull):
            client.submit([make_request([2], max_new_tokens=1)])
        with pytest.raises(ValueError):
            client.submit([make_request([], request_id="empty")])
        in_flight = client.in_flight
        await client.stop(drain=False)
        return in_flight

    assert run(main) == 2


def test_a_killed_core_fails_every_waiting_request_at_once(make_client):
    client = make_client(max_slots=1)

    async def main():
        await client.start()
        running = await running_request(client, make_request([1, 2], max_new_tokens=100, ignore_eos=True))
        [waiting] = client.submit([make_request([3], max_new_tokens=5)])  # no free slot: queued
        os.kill(client._core.pid, signal.SIGKILL)
        results = [await collect(running), await collect(waiting)]
        alive = client.running
        with pytest.raises(EngineStopped):
            client.submit([make_request([1], max_new_tokens=1)])
        await client.stop()
        return results, alive

    results, alive = run(main)
    for _, result in results:
        assert isinstance(result, RequestFailed) and "died" in result.message
    assert not alive


def test_a_core_that_cannot_load_its_model_fails_start_with_its_reason(make_client, tmp_path):
    client = make_client(model_dir=tmp_path / "missing")

    async def main():
        with pytest.raises(RuntimeError, match="missing"):
            await client.start(timeout=WAIT)
        assert not client.running

    run(main)


@pytest.mark.parametrize("supervisor_ends", ["while the client waits", "before it starts"])
def test_one_of_several_http_processes_stops_waiting_for_the_core_when_its_supervisor_ends(
    make_client, tmp_path, supervisor_ends
):
    """--api-servers N: no core answers a process whose supervisor has died (the core dies with
    it); start() must give up then, not at its timeout, so the port's socket is let go."""
    run_dir = RunDir(tmp_path / "run", api_servers=1)
    run_dir.create()
    supervisor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    if supervisor_ends == "before it starts":
        supervisor.wait()
    client = make_client(link=CoreLink(run_dir, 0, supervisor_pid=supervisor.pid))
    timeout = 30.0  # far past the supervisor's 1.5 s: giving up at the timeout fails the match

    async def main():
        with pytest.raises(RuntimeError, match="supervisor exited"):
            await client.start(timeout=timeout)
        assert not client.running

    try:
        run(main)
    finally:
        supervisor.kill()
        supervisor.wait()
