"""The engine core's process: load the model, then step in this process's main thread.

Started by service/http/core_process.py (multiprocessing, spawn). The loop, as vLLM V1's EngineCore:
take every message waiting (blocking only while idle), run one step, send its CoreOutput.
The HTTP process owns shutdown: SIGINT and SIGTERM are ignored here (a Ctrl-C or a container
stop reaches the whole process group, and the HTTP side then drains us with a Shutdown message),
and the core exits by itself if the HTTP process dies.
With --api-servers N (service/workers.py) the core is the supervisor's child instead, with
one socket pair per HTTP process: it sends each step's outputs to the process that owns each
request (service/engine/routing.py), never blocking on a process that is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from model.config import DTYPES
from model.quantized import QUANTIZE_METHODS, int8_weight_levels
from service.engine.gc_heap import freeze_startup_heap
from service.engine.adapters import UnknownAdapter
from service.engine.core import EngineConfig, EngineCore
from service.engine.grammar import Grammars
from service.engine.memory import bound_core_memory
from service.engine.protocol import (
    AbortRequests,
    AdapterCommand,
    AdapterNames,
    AddRequests,
    CoreExit,
    CoreOutput,
    CoreReady,
    Hello,
    Shutdown,
    encoder,
    to_core,
)
from service.engine.routing import Owners
from service.engine.types import CoreStep, EngineStopped, QueueFull, RequestFailed, StepStats, StepTokens
from weights.tokenizer import GPT2Tokenizer

log = logging.getLogger(__name__)

# While idle, wake this often to notice a dead HTTP process.
IDLE_POLL_MS = 500
# After a step that computed nothing (its requests wait on a grammar compiling on its own thread),
# wait this long for messages before the next: stepping at once spun hundreds of empty steps per
# compile, holding the GIL the compile wants.
WAITING_POLL_MS = 1


@dataclass(frozen=True)
class CoreProcessConfig:
    model_dir: Path
    device: str
    dtype: str  # a key of model.config.DTYPES
    threads: int | None
    engine: EngineConfig
    eos_token_id: int
    # One per HTTP process, which binds them: its PUSH socket (the core's input) and its PULL.
    input_addresses: tuple[str, ...] = ()
    output_addresses: tuple[str, ...] = ()
    quantize: str = "none"  # a model.quantized.QUANTIZE_MODES name; this process's model only


def run_core(config: CoreProcessConfig) -> None:
    """multiprocessing target: never returns normally before a Shutdown or the parent's death."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    parent = os.getppid()
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    for address in config.input_addresses:
        inputs.connect(address)
    outputs = [context.socket(zmq.PUSH) for _ in config.output_addresses]
    for sock, address in zip(outputs, config.output_addresses):
        sock.connect(address)
    loop = CoreLoop(inputs, outputs, parent)
    try:
        bound_core_memory()  # before the model: its caches are sized when first used
        loop.core = build_core(config)
        freeze_startup_heap("engine core")
        loop.send_all(CoreReady(os.getpid(), loop.core.adapters.names))
        reason = loop.run()
    except Exception as exc:
        log.exception("engine core failed")
        reason = f"engine core failed: {type(exc).__name__}: {exc}"
    loop.send_all(CoreExit(reason))
    for sock in outputs:
        sock.close(linger=2000)  # let the last messages leave before the process ends
    inputs.close(linger=0)
    context.term()


def build_core(config: CoreProcessConfig) -> EngineCore:
    from weights.checkpoint import load_model

    if config.threads:
        torch.set_num_threads(config.threads)
    model = load_model(config.model_dir, device=config.device, dtype=DTYPES[config.dtype])
    if config.quantize != "none":
        # Here only: the HTTP process's copy, which the analysis routes read, stays float.
        float_bytes = model.served_weight_bytes()
        model.quantize(config.quantize)
        served = model.served_weight_bytes()
        detail = f", weights on +-{int8_weight_levels()} levels" if config.quantize == "int8" else ""
        log.info("serving %s weights: %.1f MB, %.1f%% of %s's %.1f MB%s. %s", config.quantize, served / 1e6,
                 100 * served / float_bytes, config.dtype, float_bytes / 1e6, detail, QUANTIZE_METHODS[config.quantize])
    grammars = Grammars.for_tokenizer(GPT2Tokenizer.from_dir(config.model_dir), model.config.vocab_size)
    return EngineCore(model, config.eos_token_id, config.engine, grammars=grammars)


class CoreLoop:
    def __init__(self, inputs: zmq.Socket, outputs: list[zmq.Socket], parent_pid: int) -> None:
        self.core: EngineCore | None = None  # set once the model is loaded
        self.inputs = inputs
        self.outputs = outputs
        self.owners = Owners(len(outputs)) if len(outputs) > 1 else None
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(inputs, zmq.POLLIN)
        self.stopping = False
        self.deadline: float | None = None
        self.sent: StepStats | None = None  # the stats of the last step sent

    def run(self) -> str:
        waiting = False  # the last step computed nothing
        while True:
            idle = not self.core.has_work() and not self.stopping
            self._take_messages(IDLE_POLL_MS if idle else WAITING_POLL_MS if waiting else 0)
            if os.getppid() != self.parent_pid:
                return "the HTTP process is gone"
            if self.stopping:
                if self.deadline is not None and time.monotonic() > self.deadline:
                    self.core.scheduler.cancel_all()
                    self.deadline = None  # the cancellations finish at the next step
                if not self.core.has_work():
                    return "shut down"
            if self.core.has_work():
                step = self.core.step()
                # Tokens first: a step that streams tokens (the common one) calls nothing more.
                waiting = not step.tokens.token_ids and step.computed_nothing()
                # An empty step is news only when it moved a gauge (a request admitted to wait).
                if not waiting or self.sent is None or step.stats.gauges() != self.sent.gauges():
                    self._send(step)

    def _take_messages(self, timeout: int) -> None:
        while self.poller.poll(timeout):
            self._answer(self.inputs.recv())
            timeout = 0

    def _answer(self, raw: bytes) -> None:
        """Handle one message from an HTTP process. Whatever it raises is answered as that
        message's error: no message can end the core (only the step loop's own failure may)."""
        message = None
        try:
            message = to_core.decode(raw)
            self._handle(message)
        except Exception as exc:
            log.exception("the engine core could not handle %s", type(message).__name__ if message else "a message")
            self._refuse(message, f"{type(exc).__name__}: {exc}")

    def _refuse(self, message, error: str) -> None:
        """Answer a message that raised with its error: each of its requests fails, an adapter
        command gets the error as its answer; an abort or a handshake that raised has no one
        waiting on an answer but the log."""
        if isinstance(message, AddRequests):
            request_ids = [r.request_id for r in message.requests]
            refused = set(request_ids)  # any of them queued before the failure leaves again, unseen
            self.core.scheduler.refuse_waiting(lambda state: state.request.request_id in refused)
            self._send_failed(request_ids, f"refused by the engine core: {error}")
        elif isinstance(message, AdapterCommand):
            self.send_all(AdapterNames(self.core.adapters.names, message.client, message.ticket, error))

    def _handle(self, message) -> None:
        if isinstance(message, AddRequests):
            request_ids = [r.request_id for r in message.requests]
            if self.owners is not None:
                self.owners.add(request_ids, message.client)
            try:
                self.core.submit(message.requests)
            except (ValueError, QueueFull, EngineStopped) as exc:
                # The HTTP side checked all this before sending; say so rather than drop them.
                unknown_adapter = isinstance(exc, UnknownAdapter)
                self._send_failed(request_ids, str(exc) if unknown_adapter else f"refused by the engine core: {exc}",
                                  404 if unknown_adapter else 500)
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                self.core.cancel(request_id)
        elif isinstance(message, Hello):
            # A restarted HTTP process: its predecessor's requests have nobody to go to.
            for request_id in self.owners.of_client(message.client) if self.owners else []:
                self.core.cancel(request_id)
            self._send_to(message.client, CoreReady(os.getpid(), self.core.adapters.names))
        elif isinstance(message, AdapterCommand):
            error = None
            try:
                if message.folder is None:
                    self.core.adapters.unload(message.name)
                    self.core.free_unloaded_adapters()  # now, if no request uses it: no step may come
                else:
                    self.core.adapters.load(message.name, message.folder)
            except (ValueError, OSError) as exc:  # AdapterError is a ValueError: one line naming what is wrong
                error = str(exc)
            # Every HTTP process learns the new list; the sender also gets its answer.
            self.send_all(AdapterNames(self.core.adapters.names, message.client, message.ticket, error))
        elif isinstance(message, Shutdown):
            self.stopping = True
            self.core.scheduler.close()
            if not message.drain:
                self.core.scheduler.cancel_all()
            elif message.timeout is not None:
                self.deadline = time.monotonic() + message.timeout

    def _send(self, step: CoreStep) -> None:
        self.sent = step.stats
        if self.owners is None:  # the one HTTP process is our parent: each step's message goes there
            message = CoreOutput(step)
            try:  # inline: the token's path calls no function more
                data = encoder.encode(message)
            except Exception:
                data = self._encoded_apart(message)
            self.outputs[0].send(data)
            return
        for client, part in enumerate(self.owners.split(step)):
            self._send_to(client, CoreOutput(part))

    def send_all(self, message) -> None:
        for client in range(len(self.outputs)):
            self._send_to(client, message)

    def _send_to(self, client: int, message) -> None:
        try:
            data = encoder.encode(message)
        except Exception:
            data = self._encoded_apart(message)
        if self.owners is None:
            self.outputs[0].send(data)  # the one HTTP process is our parent
            return
        try:
            # An HTTP process that died leaves its messages queued (up to the high-water mark)
            # for its restarted successor, which ignores what it did not ask for; never wait.
            self.outputs[client].send(data, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("HTTP process %d is not reading: a message for it was dropped", client)

    def _encoded_apart(self, message) -> bytes:
        """The bytes of a message whose encoding raised (called while that error is handled). A
        step's (a value of one request's that is not plain data) is sent without the requests
        whose own part cannot be: each of those fails alone and is stopped, where the raise would
        have ended the core. Any other message's error is raised again."""
        if not isinstance(message, CoreOutput):
            raise  # the error the caller is handling
        log.exception("a step's output could not be encoded; the requests whose part of it cannot be fail alone")
        return encoder.encode(CoreOutput(self._encodable(message.step)))

    def _encodable(self, step: CoreStep) -> CoreStep:
        """The step without the requests whose part of it cannot be encoded: each fails instead."""
        ids = step.request_ids()
        by_request = Owners(len(ids))  # each request its own part
        for place, request_id in enumerate(ids):
            by_request.add([request_id], place)
        kept = CoreStep(StepTokens(), [], [], [], step.stats)
        for request_id, part in zip(ids, by_request.split(step)):
            try:
                encoder.encode(CoreOutput(part))
            except Exception as exc:
                self.core.cancel(request_id)
                reason = f"{type(exc).__name__}: {exc}".encode("utf-8", "backslashreplace").decode()
                kept.failed.append(RequestFailed(request_id, f"its output could not be sent: {reason}", cause="output"))
                continue
            for token in part.tokens:
                kept.tokens.append(token)
            kept.started += part.started
            kept.done += part.done
            kept.failed += part.failed
        return kept

    def _send_failed(self, request_ids: list[str], message: str, status: int = 500) -> None:
        cache = self.core.cache
        stats = StepStats(0, 0, 0, len(self.core.scheduler.running), self.core.scheduler.waiting.count,
                          cache.slots_used, cache.max_slots, 0.0)
        error_type = "not_found" if status == 404 else "generation"
        failed = [RequestFailed(r, message, status, error_type, "refused") for r in request_ids]
        self._send(CoreStep(StepTokens(), [], [], failed, stats))
