"""The engine core's message loop (service/engine/process.py): whatever a message from an HTTP
process raises is answered as that message's error, and the core goes on serving; an adapter
unloaded while nothing runs is freed at once, not at some later step."""

from __future__ import annotations

import threading

import msgspec
import numpy as np
import pytest
import zmq

from service.engine.process import CoreLoop
from service.engine.protocol import AbortRequests, AdapterCommand, AddRequests, AdapterNames, CoreOutput, Hello, encoder, from_core
from service.engine.routing import Owners
from tests.engine.conftest import make_request, random_prompt
from tests.model.test_lora import PEFT_CONFIGS, peft_adapter

peft = pytest.importorskip("peft")


class Outbox:
    """Stands for the PUSH socket to the one HTTP process: keeps what the core sends."""

    def __init__(self) -> None:
        self.messages = []

    def send(self, data: bytes, flags: int = 0) -> None:
        self.messages.append(from_core.decode(data))


@pytest.fixture
def loop(make_engine):
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    loop = CoreLoop(inputs, [Outbox()], parent_pid=0)
    loop.core = make_engine().core
    yield loop
    inputs.close(linger=0)
    context.term()


def sent(loop) -> list:
    return loop.outputs[0].messages


def test_an_adapter_command_that_raises_anything_is_answered_with_its_error(loop, monkeypatch):
    for error in (RecursionError("maximum recursion depth exceeded"), TypeError("'int' object is not iterable"),
                  KeyError("target_modules")):
        def broken(name, folder, error=error):
            raise error
        monkeypatch.setattr(loop.core.adapters, "load", broken)
        loop._answer(encoder.encode(AdapterCommand(ticket=7, name="x", folder="/nowhere")))
        answer = sent(loop)[-1]
        assert isinstance(answer, AdapterNames) and answer.ticket == 7
        assert type(error).__name__ in answer.error and str(error.args[0]) in answer.error


def test_requests_whose_submission_raises_fail_alone_and_the_core_serves_on(loop, monkeypatch):
    submit = loop.core.submit

    def broken(requests):
        submit(requests)  # queued, then something goes wrong: they must leave again
        raise TypeError("unexpected")

    monkeypatch.setattr(loop.core, "submit", broken)
    doomed = [make_request([1, 2, 3], "doomed-1", max_new_tokens=3), make_request([4, 5], "doomed-2", max_new_tokens=3)]
    loop._answer(encoder.encode(AddRequests(doomed)))
    [output] = [m for m in sent(loop) if isinstance(m, CoreOutput)]
    assert sorted(f.request_id for f in output.step.failed) == ["doomed-1", "doomed-2"]
    assert all("TypeError: unexpected" in f.message and f.cause == "refused" for f in output.step.failed)
    monkeypatch.setattr(loop.core, "submit", submit)
    loop._answer(encoder.encode(AddRequests([make_request([1, 2, 3], "fine", max_new_tokens=3)])))
    done = []
    while loop.core.has_work():
        done += [d.request_id for d in loop.core.step().done]
    assert done == ["fine"]  # the doomed ones were cancelled before any step: nothing of theirs ran


def test_undecodable_and_raising_messages_leave_the_loop_standing(loop, monkeypatch):
    loop._answer(b"\x93not a message")
    loop._answer(msgspec.msgpack.encode({"type": "Unknown"}))
    monkeypatch.setattr(loop.core, "cancel", lambda request_id: 1 / 0)
    loop._answer(encoder.encode(AbortRequests(["x"])))
    monkeypatch.setattr(loop, "owners", None)
    loop._answer(encoder.encode(Hello(client=0)))
    assert sent(loop)[-1].pid  # the handshake still answered


def test_an_adapter_unloaded_while_idle_is_freed_at_once(loop, tiny_model_dir, tmp_path):
    folder = peft_adapter(tmp_path / "c", tiny_model_dir, seed=1, **PEFT_CONFIGS["attention-only"])
    loop._answer(encoder.encode(AdapterCommand(ticket=1, name="c", folder=str(folder))))
    assert sent(loop)[-1].error is None
    request = make_request(random_prompt(5, seed=3), "uses-c", max_new_tokens=4)
    request.adapter = "c"
    loop.core.submit([request])
    while loop.core.has_work():
        loop.core.step()
    loop._answer(encoder.encode(AdapterCommand(ticket=2, name="c", folder=None)))
    assert sent(loop)[-1].error is None
    assert "c" not in loop.core.adapters.set and not loop.core.adapters.unloading  # freed with no step after
    loop._answer(encoder.encode(AdapterCommand(ticket=3, name="c", folder=str(folder))))
    assert sent(loop)[-1].error is None and "c" in sent(loop)[-1].names


@pytest.mark.parametrize("api_servers", [1, 2])
def test_a_step_with_a_value_that_cannot_be_sent_fails_only_that_request(loop, monkeypatch, api_servers):
    """One request's part of a step is not plain data (here a numpy integer as its token, which
    msgpack cannot encode): that request fails alone and is stopped; the others' tokens of the
    same step and after reach the HTTP side, and the core goes on (the raise used to end it).
    With two HTTP processes, the steps go to the second, which sent the requests."""
    if api_servers == 2:
        loop.outputs, loop.owners = [Outbox(), Outbox()], Owners(2)
    loop._answer(encoder.encode(AddRequests([make_request(random_prompt(4, seed=seed), f"r{seed}", max_new_tokens=6)
                                             for seed in range(3)], client=api_servers - 1)))
    step, spoiled = loop.core.step, []

    def spoiling():
        result = step()
        tokens = result.tokens
        if "r1" in tokens.request_ids and not spoiled:
            at = tokens.request_ids.index("r1")
            tokens.token_ids[at] = np.int64(tokens.token_ids[at])
            spoiled.append(at)
        return result
    monkeypatch.setattr(loop.core, "step", spoiling)
    while loop.core.has_work():
        loop._send(loop.core.step())
    assert spoiled
    outputs = [m.step for m in loop.outputs[-1].messages if isinstance(m, CoreOutput)]
    tokens = {r: sum(s.tokens.request_ids.count(r) for s in outputs) for r in ("r0", "r1", "r2")}
    # r1's token of that step went with it, and none came after: it was stopped.
    assert tokens["r0"] == tokens["r2"] == 6 and tokens["r1"] == 0
    [failed] = [f for s in outputs for f in s.failed]
    assert failed.request_id == "r1" and failed.cause == "output" and "could not be sent" in failed.message
    assert sorted(d.request_id for s in outputs for d in s.done) == ["r0", "r1", "r2"]  # r1 stopped: cancelled


class Poller:
    """Stands for the loop's poller: no message ever arrives; records each wait."""

    def __init__(self, on_poll) -> None:
        self.timeouts: list[int] = []
        self.on_poll = on_poll

    def poll(self, timeout: int) -> list:
        self.timeouts.append(timeout)
        self.on_poll(len(self.timeouts))
        return []


def test_steps_waiting_on_a_grammar_compile_wait_for_messages_and_are_sent_once(loop, monkeypatch):
    """While a request's grammar compiles on its thread, steps compute nothing: the loop waits a
    little before each next step (it spun at once before: hundreds of empty steps holding the GIL
    the compile wants), and sends such a step only when it moved a gauge."""
    import llguidance

    from service.engine import process

    grammars = loop.core.grammars
    compiled = threading.Event()
    build = grammars._build
    monkeypatch.setattr(grammars, "_build", lambda grammar: (compiled.wait(10), build(grammar))[1])
    empty_steps = 5
    steps = []
    step = loop.core.step
    monkeypatch.setattr(loop.core, "step", lambda: steps.append(step()) or steps[-1])
    loop.poller = Poller(lambda polls: compiled.set() if len(steps) >= empty_steps and not compiled.is_set() else None)
    monkeypatch.setattr(process.os, "getppid", lambda: loop.parent_pid)
    loop.core.submit([make_request(random_prompt(4, seed=3), "constrained", max_new_tokens=4,
                                   grammar=llguidance.grammar_from("regex", "[a-z]{1,8}"))])
    loop.stopping = True  # the loop returns once the request is done
    assert loop.run() == "shut down"
    done_at = next(i for i, s in enumerate(steps) if s.done)
    # The loop returned with the request done: at once, or (overlap) after the step that reads the
    # one launched beside it, which computes nothing.
    assert len(steps) - 1 - done_at <= loop.core.overlap
    waiting = [i for i, s in enumerate(steps[:done_at]) if s.computed_nothing()]
    assert len(waiting) >= empty_steps
    # The poll before step i follows step i - 1: after each empty step the loop waited.
    assert all(loop.poller.timeouts[i + 1] >= 1 for i in waiting)  # milliseconds
    outputs = [m.step for m in sent(loop) if isinstance(m, CoreOutput)]
    assert sum(s.computed_nothing() for s in outputs) == 1  # the first: the request now counts as running
    assert [d.request_id for s in outputs for d in s.done] == ["constrained"]
