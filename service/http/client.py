"""The HTTP process's handle on the engine core (vLLM V1's AsyncLLM): the front end requests use
(submit, cancel, hand_off, admission) and the delivery of the core's steps back to them.

    client = EngineClient(config, tokenizer, on_step=metrics.observe_step, max_in_flight=80)
    await client.start()                       # spawns the core, waits until its model is loaded
    queues = client.submit([request_a, ...])   # on the event loop; prefilled together
    item = await queues[0].get()               # TokenEvent* then FinishedRequest | RequestFailed
    finished = client.cancel(request_id)       # the client left: finished now, as cancelled
    await client.stop(timeout=30)              # drain: let running requests finish, then exit

Everything runs on the event loop: one reader callback receives the core's per-step messages,
turns them into text and results (service/http/outputs.py) and hands each request's items to its
queue, or, for a stream that handed off (`hand_off`), its token events to the stream's sink, which
writes them to the client at once; the step's metrics are recorded after its tokens have gone.
With a stream interval N > 1 (vLLM's and SGLang's --stream-interval) a stream's token events are
held until N have gathered, then delivered together (one write instead of N: a socket send per
token is about a third of the HTTP CPU per token at 64 streams, docs/api-servers.md); its first
token and its last go at once. A request submitted without token events (a whole answer) gets
only its result: no wake-up of its waiting task per token.
Admission is decided here, synchronously, so a refusal is an immediate 422 / 429 / 503: the core
never has to answer a request with anything but tokens.
If the core process dies, every waiting request fails at once and `running` turns False
(/health answers 503).

The core's process, its sockets and its end are service/http/core_process.py's; adapter load
and unload commands, service/http/adapter_commands.py's. With --api-servers N (service/workers.py)
the core is the supervisor's, reached through a CoreLink, and admission counts against the
in-flight count every HTTP process shares (service/http/core_link.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

from service.engine.process import CoreProcessConfig
from service.engine.protocol import AbortRequests, AdapterNames, AddRequests, CoreExit, CoreOutput, Shutdown, from_core
from service.engine.validation import validate_request
from service.engine.types import (
    CoreStep,
    EngineStopped,
    FinishedRequest,
    GenerationRequest,
    QueueFull,
    RequestFailed,
    StepStats,
    TokenEvent,
)
from service.http.adapter_commands import AdapterCommands
from service.http.core_link import CoreLink, SharedInFlight
from service.http.core_process import CoreProcess
from service.http.outputs import OutputProcessor
from weights.tokenizer import GPT2Tokenizer

log = logging.getLogger(__name__)

QueueItem = TokenEvent | FinishedRequest | RequestFailed
# Takes a request's token events (in order) and delivers them itself (True), or declines them
# (False): see hand_off.
TokenSink = Callable[[list[TokenEvent]], bool]


class EngineClient:
    def __init__(
        self,
        config: CoreProcessConfig,
        tokenizer: GPT2Tokenizer,
        on_step: Callable[[StepStats], None] | None = None,
        max_in_flight: int | None = None,
        link: CoreLink | None = None,
        stream_interval: int = 1,
    ) -> None:
        """`config`'s addresses are filled in by start(); `max_in_flight` bounds the requests
        admitted and not yet finished (running plus waiting; the whole server's, with a link);
        more get QueueFull. With `link`, attach to the core the supervisor runs.
        `stream_interval`: the token events a stream gathers before they are delivered together."""
        if stream_interval < 1:
            raise ValueError("stream_interval must be at least 1")
        if config.engine.max_len is None:
            raise ValueError("the engine config must name max_len: the HTTP side validates lengths")
        self.max_len = config.engine.max_len
        self.max_slots = config.engine.max_slots
        self.outputs = OutputProcessor(tokenizer)
        self.on_step = on_step
        self.max_in_flight = max_in_flight or config.engine.max_slots + config.engine.max_waiting
        self.last_stats: StepStats | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._sinks: dict[str, TokenSink] = {}
        self.stream_interval = stream_interval
        # With stream_interval > 1: a stream's events since its last delivery, present from its
        # first delivery on (the first goes at once: the time to first token is not traded).
        self._held: dict[str, list[TokenEvent]] = {}
        self._core = CoreProcess(config, link, on_death=self._on_core_death)
        # Done when the core's last message (CoreExit) has been read, or reading stopped.
        self._reader: asyncio.Future | None = None
        self._inbox: zmq.Socket | None = None  # the core's messages, read by _on_readable
        self._shared = SharedInFlight(link.run_dir, link.index) if link is not None else None
        self._closed = False  # stop() was called: no new work
        self._shutdown: Shutdown | None = None
        self._shutdown_sent = False
        self._dead = False
        self._adapters = AdapterCommands(self._core.send, self._core.client_index)

    # --- life cycle ------------------------------------------------------------------------------
    async def start(self, timeout: float = 300.0) -> None:
        """Start the engine core (service/http/core_process.py) and read its messages once it has
        loaded the model. Raises RuntimeError if it cannot."""
        ready = await self._core.start(timeout)
        self._adapters.names = list(ready.adapters)
        # Read by a callback on the socket's descriptor, not by awaiting zmq.asyncio's recv: its
        # futures, task wake-ups and event bookkeeping cost more than the step's own handling
        # (docs/api-servers.md). ZeroMQ's descriptor is edge-triggered: each callback reads all.
        loop = asyncio.get_running_loop()
        self._reader = loop.create_future()
        self._inbox = self._core.inbox
        loop.add_reader(self._inbox.FD, self._on_readable)
        self._on_readable()  # what arrived before the descriptor was watched signals no edge

    @property
    def running(self) -> bool:
        return self._reader is not None and not self._dead

    def close(self, timeout: float | None = None, drain: bool = True) -> None:
        """Take no new work; the core lets running requests finish and cancels what is left after
        `timeout` seconds, so their streams still end with a final event. Only the first call counts.
        One of several HTTP processes drains the shared core only when the whole server stops;
        stopped alone, it only takes no new work (the supervisor starts another)."""
        if self._closed:
            return
        self._closed = True
        self._shutdown = Shutdown(drain=drain, timeout=timeout)
        self._shut_core_down()

    def _shut_core_down(self) -> bool:
        """Send the core its Shutdown, once, if this process may; True once it has been sent."""
        if not self._shutdown_sent and self.running and self._core.may_shut_down:
            self._core.send(self._shutdown)
            self._shutdown_sent = True
        return self._shutdown_sent

    async def stop(self, timeout: float | None = None, drain: bool = True) -> None:
        """close(), then wait for the core's last results and its exit."""
        self.close(timeout, drain)
        if not self._core.attached:
            return
        # Asked again: a signal that reaches every process at once (Ctrl-C) can come before the
        # supervisor has said that the whole server stops.
        if self._shut_core_down() and self._reader is not None:
            # Reading ends on the core's CoreExit, after delivering its last results.
            grace = None if timeout is None else timeout + 10.0
            await asyncio.wait({self._reader}, timeout=grace)
        await self._core.end()
        self._stop_reading()
        self._dead = True
        self._deliver_failures("the engine core stopped")
        self._core.close()

    # --- requests ---------------------------------------------------------------------------------
    def submit(self, requests: list[GenerationRequest], token_events: bool = True) -> list[asyncio.Queue]:
        """Queue requests; raises ValueError (422), QueueFull (429) or EngineStopped (503).
        Without `token_events` a queue gets the request's result alone."""
        if self._closed or not self.running:
            raise EngineStopped("the server is shutting down" if self._closed else "the engine core is not running")
        for request in requests:
            validate_request(request, self.max_len, self.max_slots)
        if self._shared is not None:
            in_flight = self._shared.admit(len(requests), self.max_in_flight)
        else:
            in_flight = len(self.outputs) if len(self.outputs) + len(requests) > self.max_in_flight else None
        if in_flight is not None:
            raise QueueFull(f"{in_flight} requests are in flight (limit {self.max_in_flight})")
        queues = [asyncio.Queue() for _ in requests]
        self._queues.update((r.request_id, q) for r, q in zip(requests, queues))
        self.outputs.add(requests, token_events)
        self._core.send(AddRequests(requests, self._core.client_index))
        return queues

    def cancel(self, request_id: str) -> FinishedRequest | None:
        """Finish the request now, as cancelled, and free its slots in the core (None if it had
        already finished). Its queue gets nothing more."""
        self._forget(request_id)
        finished = self.outputs.abort(request_id)
        if finished is not None and self.running:
            self._core.send(AbortRequests([request_id]))
        self._publish_in_flight()
        return finished

    def hand_off(self, request_id: str, sink: TokenSink) -> None:
        """Give the request's token events to `sink` as they are delivered, instead of its queue,
        until the sink declines some or take_back is called; the declined events and everything
        after them (the request's last token and its result always) go to the queue, in order. The caller
        hands off only while its queue is empty and it waits on it: then whatever the sink
        delivers comes after all that the queue delivered (service/http/body_writer.py says why)."""
        if request_id in self._queues:
            self._sinks[request_id] = sink

    def take_back(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)

    @property
    def in_flight(self) -> int:
        return len(self.outputs)

    def _publish_in_flight(self) -> None:
        if self._shared is not None:
            self._shared.publish(len(self.outputs))

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters requests may name, as the core last said."""
        return self._adapters.names

    async def adapter_command(self, name: str, folder: str | None, timeout: float = 300.0) -> None:
        """Load the peft folder as LoRA adapter `name` in the engine core, or unload it (folder
        None). Raises ValueError with the core's one-line reason when it refuses."""
        if not self.running:
            raise RuntimeError("the engine core is not running")
        await self._adapters.run(name, folder, timeout)

    # --- the core's messages ------------------------------------------------------------------------
    def _on_readable(self) -> None:
        inbox = self._inbox
        while self._reader is not None and not self._reader.done() and inbox.get(zmq.EVENTS) & zmq.POLLIN:
            message = None
            try:
                message = from_core.decode(inbox.recv(zmq.NOBLOCK))
                if isinstance(message, CoreOutput):  # nearly every message: a step's output
                    self._take_step(message)
                else:
                    self._take_message(message)
            except Exception as exc:  # one bad step must not stop every stream's reading
                log.exception("handling the engine core's message failed")
                if isinstance(message, CoreOutput):
                    self._fail_step(message.step, exc)

    def _take_message(self, message) -> None:
        if isinstance(message, CoreExit):
            if message.reason != "shut down":
                log.error("engine core exited: %s", message.reason)
            self._dead = True
            self._deliver_failures(f"the engine core exited: {message.reason}")
            self._stop_reading()
        elif isinstance(message, AdapterNames):
            self._adapters.take(message)

    def _stop_reading(self) -> None:
        if self._reader is None or self._reader.done():
            return
        asyncio.get_running_loop().remove_reader(self._inbox.FD)
        self._reader.set_result(None)

    def _take_step(self, message: CoreOutput) -> None:
        """Deliver a step: its token events first (a stream's in one write by its sink, or to its
        queue), then its results, then its stats to metrics."""
        step = message.step
        processed = self.outputs.process(step)
        if processed.abort:
            self._core.send(AbortRequests(processed.abort))
        ended = [*processed.finished, *processed.failed]
        # A request's last token goes with its result, to its queue (TGI puts the result on it).
        ending = {result.request_id for result in ended} if ended else ()
        events = processed.events if self.stream_interval == 1 else self._gather(processed.events, ending)
        sinks, queues = self._sinks, self._queues
        for request_id, mine in events.items():
            sink = sinks.get(request_id)
            if sink is not None:
                if request_id not in ending:
                    try:
                        if sink(mine):
                            continue
                    except Exception:  # the reader serves every request: one sink's bug must not end it
                        log.exception("a token sink failed; its request goes on through its queue")
                del sinks[request_id]
            queue = queues.get(request_id)
            if queue is not None:
                for event in mine:
                    queue.put_nowait(event)
        for result in ended:
            queue = queues.get(result.request_id)
            self._forget(result.request_id)
            if queue is not None:
                queue.put_nowait(result)
        if ended:
            self._publish_in_flight()
        # The stats after the tokens: no token waits for metrics. A client that reads /metrics
        # right after its reply still sees the step that finished it (gauges such as KV-cache
        # usage): results reach it through queues, read once this callback has returned.
        self.last_stats = step.stats
        if self.on_step is not None:
            try:
                self.on_step(step.stats)
            except Exception:
                log.exception("on_step callback failed")

    def _gather(self, events: dict[str, list[TokenEvent]], ending: set[str] | tuple) -> dict[str, list[TokenEvent]]:
        """With a stream interval N > 1, the step's token events as they are to be delivered now:
        a stream's held events in front of its new ones once N have gathered or the request ends,
        else nothing yet (its first delivery goes at once)."""
        held, interval = self._held, self.stream_interval
        for request_id in ending:  # its held events go out with its last ones (or its result)
            if held.get(request_id) and request_id not in events:
                events[request_id] = []
        for request_id in list(events):
            before = held.get(request_id)
            if before is None:  # the stream's first delivery
                if request_id not in ending:
                    held[request_id] = []
                continue
            before += events[request_id]
            if request_id in ending or len(before) >= interval:
                events[request_id] = before
                held[request_id] = []
            else:
                del events[request_id]
        return events

    def _fail_step(self, step: CoreStep, exc: Exception) -> None:
        """Handling a step raised where no one request's output is to blame: its requests fail
        (500) and are stopped in the core, rather than wait for the tokens that were lost."""
        try:
            ids = step.request_ids()
            message = f"handling the engine's output failed: {type(exc).__name__}: {exc}"
            failed = self.outputs.fail_requests(ids, message)
            # Those the processor had already finished (their results made, not yet queued).
            held = {f.request_id for f in failed}
            failed += [RequestFailed(request_id, message, cause="output") for request_id in ids
                       if request_id in self._queues and request_id not in held]
            if failed:
                self._core.send(AbortRequests([f.request_id for f in failed]))
            self._deliver(failed)
        except Exception:
            log.exception("failing the requests of a step that could not be handled failed")

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._sinks.pop(request_id, None)
        self._held.pop(request_id, None)

    def _on_core_death(self, reason: str) -> None:
        """The core's process ended. A clean shutdown is finished by the reader; a crash fails
        every waiting request now rather than leaving its client hanging."""
        if self._closed:
            return
        log.error(reason)
        self._dead = True
        self._stop_reading()
        self._deliver_failures(reason)

    def _deliver_failures(self, message: str) -> None:
        self._sinks.clear()
        self._adapters.fail(message)
        self._deliver(self.outputs.fail_all(message))

    def _deliver(self, failures: list[RequestFailed]) -> None:
        for failed in failures:
            queue = self._queues.get(failed.request_id)
            held = self._held.get(failed.request_id, ())  # what it generated still reaches the client
            self._forget(failed.request_id)
            if queue is not None:
                for event in held:
                    queue.put_nowait(event)
                queue.put_nowait(failed)
        self._publish_in_flight()
