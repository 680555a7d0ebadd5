"""The engine core process as the HTTP process holds it: started (or reached), linked by a pair
of ZeroMQ sockets, watched for its end, and let go.

    core = CoreProcess(config, link=None, on_death=fail_everything)
    ready = await core.start(timeout=300)   # CoreReady once its model is loaded; RuntimeError if not
    core.send(AddRequests(...))             # to the core; its messages arrive on core.inbox
    await core.end()                        # join (or kill) it and stop watching it
    core.close()                            # then the sockets

Without a link the core is this process's child: the sockets are bound in a fresh directory and
the core is spawned with their addresses. With --api-servers N (service/workers.py) it is the
supervisor's: given a CoreLink, the process binds its own pair of sockets in the run directory,
says Hello to the core and watches its pid through a pidfd (service/http/core_link.py). Either
way the core's end is noticed by the descriptor that becomes readable then, and a crash is
reported to `on_death` at once. Reading the core's messages is the client's
(service/http/client.py): nearly each one is a step whose tokens the reader hands on at once, so
the reading sits with the delivery, on a token's path (docs/engine.md, "One token's path").
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace

import zmq
import zmq.asyncio

from service.engine.process import CoreProcessConfig, run_core
from service.engine.protocol import CoreExit, CoreReady, Hello, encoder, from_core
from service.http.core_link import CoreLink


class CoreProcess:
    def __init__(self, config: CoreProcessConfig, link: CoreLink | None, on_death: Callable[[str], None]) -> None:
        """`config`'s addresses are filled in by start(); `on_death` gets the reason when the core's
        process ends, unless end() was called first."""
        self.config = config
        self.link = link
        self._on_death = on_death
        self.pid: int | None = None  # the core's, once it has answered
        self._process: multiprocessing.process.BaseProcess | None = None
        self._context: zmq.asyncio.Context | None = None
        self._to_core: zmq.asyncio.Socket | None = None
        self._from_core: zmq.asyncio.Socket | None = None
        self.inbox: zmq.Socket | None = None  # _from_core as a plain socket, for a reader callback
        self._socket_dir: str | None = None
        self._exit_fd: int | None = None  # readable when the core's process ends

    @property
    def client_index(self) -> int:
        """This HTTP process's number, as the core addresses its answers."""
        return self.link.index if self.link is not None else 0

    @property
    def may_shut_down(self) -> bool:
        """Its own child, or the shared core once the supervisor stops the whole server: one of
        several HTTP processes stopped alone leaves the core to the others."""
        return self.link is None or self.link.run_dir.stopping

    @property
    def attached(self) -> bool:
        """Started and not yet ended: there is a process to join or a pidfd to close."""
        return self._process is not None or self._exit_fd is not None

    async def start(self, timeout: float) -> CoreReady:
        """Spawn the core (or, with a link, reach the supervisor's) and wait until it has loaded
        the model. Raises RuntimeError if it cannot, having let everything go."""
        self._context = zmq.asyncio.Context()
        self._to_core = self._context.socket(zmq.PUSH)
        self._from_core = self._context.socket(zmq.PULL)
        if self.link is not None:
            inputs, outputs = self.link.input_address, self.link.output_address
        else:
            self._socket_dir = tempfile.mkdtemp(prefix="gpt2-core-")
            inputs, outputs = (f"ipc://{self._socket_dir}/{name}" for name in ("in", "out"))
        self._to_core.bind(inputs)
        self._from_core.bind(outputs)
        if self.link is None:
            config = replace(self.config, input_addresses=(inputs,), output_addresses=(outputs,))
            # spawn, not fork: the HTTP process has threads (and, on a GPU, a CUDA context).
            self._process = multiprocessing.get_context("spawn").Process(
                target=run_core, args=(config,), name="gpt2-engine-core", daemon=True
            )
            self._process.start()
        try:
            ready = await asyncio.wait_for(self._handshake(), timeout)
        except asyncio.TimeoutError:
            ready = CoreExit(f"the engine core did not start within {timeout:.0f} s")
        if not isinstance(ready, CoreReady):
            await self.end()
            self.close()
            raise RuntimeError(getattr(ready, "reason", f"unexpected first message {ready!r}"))
        self.pid = ready.pid
        # Its own child's sentinel; another's pid, through a pidfd: either is readable at its end.
        self._exit_fd = self._process.sentinel if self._process is not None else os.pidfd_open(ready.pid)
        asyncio.get_running_loop().add_reader(self._exit_fd, self._on_exit)
        self.inbox = zmq.Socket.shadow(self._from_core.underlying)
        return ready

    async def _handshake(self) -> CoreReady | CoreExit:
        if self.link is None:
            return from_core.decode(await self._from_core.recv())
        # One of several HTTP processes: the supervisor's core answers, unless the supervisor
        # ends first (its core goes with it). Its death signal reaches this process, but uvicorn
        # only flags an exit while the start-up waits, so without this watch the process would
        # keep the port's socket for the whole start-up timeout.
        orphaned = CoreExit("the supervisor exited before the engine core was ready")
        try:
            supervisor = os.pidfd_open(self.link.supervisor_pid)
        except ProcessLookupError:
            return orphaned
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        loop.add_reader(supervisor, lambda: ended.done() or ended.set_result(None))
        answer = asyncio.ensure_future(self._linked_handshake())
        try:
            await asyncio.wait({answer, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            loop.remove_reader(supervisor)
            os.close(supervisor)
            if not answer.done():
                answer.cancel()
        return answer.result() if answer.done() else orphaned

    async def _linked_handshake(self) -> CoreReady | CoreExit:
        await self._to_core.send(encoder.encode(Hello(self.link.index)))
        while True:
            # A restarted process may first get what the core queued for its predecessor.
            message = from_core.decode(await self._from_core.recv())
            if isinstance(message, (CoreReady, CoreExit)):
                return message

    def send(self, message) -> None:
        # A PUSH to a connected peer does not block below its high-water mark (1000 messages).
        self._to_core.send(encoder.encode(message), copy=False)

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._exit_fd)
        # The exit code is known only to the core's parent (this process, or the supervisor).
        died = "the engine core process died"
        if self._process is not None:
            died += f" (exit code {self._process.exitcode})"
        self._on_death(died)

    async def end(self) -> None:
        """Stop watching the core, and end it if it is this process's child (after its Shutdown,
        it exits by itself: it is given 5 s)."""
        process, self._process = self._process, None
        if self._exit_fd is not None:
            asyncio.get_running_loop().remove_reader(self._exit_fd)
            if process is None:
                os.close(self._exit_fd)
            self._exit_fd = None
        if process is not None:
            await asyncio.to_thread(process.join, 5.0)
            if process.is_alive():
                process.kill()  # it ignores SIGTERM: the HTTP side owns its shutdown
                await asyncio.to_thread(process.join)

    def close(self) -> None:
        """Close the sockets (and remove their directory): nothing more is sent or read."""
        for sock in (self._to_core, self._from_core):
            if sock is not None:
                sock.close(linger=0)
        self._to_core = self._from_core = self.inbox = None
        if self._context is not None:
            self._context.term()
            self._context = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
