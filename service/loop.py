"""The engine in a background thread, off the asyncio event loop.

The HTTP side calls `submit` from its event loop and reads each request's asyncio.Queue:
TokenEvent* then one FinishedRequest (or RequestFailed). The engine thread hands results back
with loop.call_soon_threadsafe, once per step for everything that step produced.

    loop = EngineLoop(engine, on_step=metrics.observe_step)
    loop.start()
    queues = loop.submit([request_a, request_b])   # inside a coroutine; prefilled together
    while not isinstance(item := await queues[0].get(), (FinishedRequest, RequestFailed)): ...
    loop.cancel(request_a.request_id)              # e.g. the client went away
    await loop.stop(timeout=30)                    # on shutdown: drain in-flight work first
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from collections.abc import Callable

from service.engine import Engine
from service.requests import (
    FinishedRequest,
    GenerationRequest,
    RequestFailed,
    StepStats,
    TokenEvent,
)

log = logging.getLogger(__name__)

QueueItem = TokenEvent | FinishedRequest | RequestFailed


class EngineLoop:
    def __init__(self, engine: Engine, on_step: Callable[[StepStats], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step
        self._wake = threading.Condition()
        self._stopping = False
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._routes_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # --- called from the event loop -------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, requests: list[GenerationRequest]) -> list[asyncio.Queue]:
        """Queue requests (several prompts of one call are prefilled together).

        Must be called inside the event loop that reads the queues. Raises ValueError (the
        request can never run: 422), QueueFull (429) or EngineStopped (503); nothing is queued
        then.
        """
        event_loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in requests]
        with self._routes_lock:
            for request, queue in zip(requests, queues):
                self._routes.setdefault(request.request_id, (event_loop, queue))
        try:
            self.engine.submit(requests)
        except Exception:
            with self._routes_lock:
                for request, queue in zip(requests, queues):
                    if self._routes.get(request.request_id, (None, None))[1] is queue:
                        del self._routes[request.request_id]
            raise
        with self._wake:
            self._wake.notify()
        return queues

    def cancel(self, request_id: str) -> None:
        """Free the request's slots at the next step; its queue then gets a cancelled result."""
        self.engine.cancel(request_id)
        with self._wake:
            self._wake.notify()

    async def stop(self, timeout: float | None = None, drain: bool = True) -> None:
        await asyncio.to_thread(self.shutdown, timeout, drain)

    # --- any thread -------------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None, drain: bool = True) -> None:
        """Take no new work; finish in-flight requests (drain) or cancel them, then stop.

        Blocks: from a coroutine use `await loop.stop(...)`. With drain, whatever is still
        running after `timeout` seconds (None: no limit) is cancelled.
        """
        self.engine.scheduler.close()
        if not drain:
            self.engine.scheduler.cancel_all()
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.engine.scheduler.cancel_all()
            self._thread.join()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self.engine.has_work() and not self._stopping:
                    self._wake.wait()
                if not self.engine.has_work():
                    return  # stopping, and everything in flight has finished
            output = self.engine.step()
            # Stats first: a client that reads /metrics right after its reply must see the
            # step that finished it (gauges such as KV-cache usage), not the one before.
            if self.on_step is not None:
                try:
                    self.on_step(output.stats)
                except Exception:
                    log.exception("on_step callback failed")
            self._deliver([*output.events, *output.finished, *output.failed])

    def _deliver(self, items: list[QueueItem]) -> None:
        """Hand items to their requests' queues: one call_soon_threadsafe per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, QueueItem]]] = defaultdict(list)
        with self._routes_lock:
            for item in items:
                route = self._routes.get(item.request_id)
                if route is None:
                    continue
                if isinstance(item, (FinishedRequest, RequestFailed)):
                    del self._routes[item.request_id]
                by_loop[route[0]].append((route[1], item))
        for event_loop, batch in by_loop.items():
            try:
                event_loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:
                log.warning("event loop closed; dropped %d results", len(batch))


def _put_all(batch: list[tuple[asyncio.Queue, QueueItem]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
