"""The HTTP process's handle on the analysis process (service/analysis/process.py).

    client = AnalysisClient.spawning(config)        # a lone server: its own analysis process
    client = AnalysisClient(address, supervisor)    # one of --api-servers N: the supervisor's
    await client.start()                            # until the models are loaded (RuntimeError if not)
    answer = await client.call(Spectrum(...))       # Done | Refused | Failed; AnalysisUnavailable
    await client.load_adapter("poems", "weights/lora-poems")   # ValueError: why the folder is refused
    await client.unload_adapter("poems")                       # ValueError: no adapter of that name
    await client.stop()

Calls wait on the event loop for their answer, costing this process nothing meanwhile. The
analysis process's pid is watched (a pidfd): when it ends, every waiting call and every later
one raises AnalysisUnavailable at once (503), never a hang.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path

import zmq
import zmq.asyncio

from service.analysis.process import AnalysisProcessConfig, run_analysis
from service.analysis.protocol import (
    Done, Failed, Hello, ListAdapters, LoadAdapter, Ready, Refused, Request, UnloadAdapter, analysis_address, encoder,
    replies,
)

STOPPED = "the analysis process has stopped; /analyze is unavailable until the server is restarted"


class AnalysisUnavailable(RuntimeError):
    """The analysis process is gone (or was never reached)."""


class AnalysisClient:
    def __init__(self, address: str, supervisor_pid: int | None = None, spawn: AnalysisProcessConfig | None = None) -> None:
        """`supervisor_pid`: whose end, while waiting for the first answer, means that no analysis
        process will ever answer (it goes with the supervisor). `spawn`: start it here."""
        self.address = address
        self.supervisor_pid = supervisor_pid
        self.spawn = spawn
        self._run_dir: str | None = None  # a lone server's, for the socket
        self._process: multiprocessing.process.BaseProcess | None = None
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._pidfd: int | None = None
        self.pid: int | None = None
        self.stopped: str | None = None  # why calls are refused, once they are

    @classmethod
    def spawning(cls, config: AnalysisProcessConfig) -> "AnalysisClient":
        """A lone server's: its socket in a directory of its own, made at start()."""
        return cls(config.address, spawn=config)

    async def start(self, timeout: float = 300.0) -> None:
        if self.spawn is not None:
            self._run_dir = tempfile.mkdtemp(prefix="gpt2-analysis-")
            self.address = analysis_address(Path(self._run_dir))
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.address)
        self._reader = asyncio.ensure_future(self._read())
        if self.spawn is not None:
            config = AnalysisProcessConfig(**{**self.spawn.__dict__, "address": self.address})
            # spawn, not fork: this process has threads; the child initialises its device alone.
            self._process = multiprocessing.get_context("spawn").Process(
                target=run_analysis, args=(config,), name="gpt2-analysis", daemon=True)
            self._process.start()
        try:
            answer = await asyncio.wait_for(self._first_answer(), timeout)
        except asyncio.TimeoutError:
            answer = Failed(f"the analysis process did not answer within {timeout:.0f} s")
        if not isinstance(answer, Ready):
            await self.stop()
            raise RuntimeError(answer.message)
        self.pid = answer.pid
        self._pidfd = os.pidfd_open(answer.pid)
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_exit)

    async def _first_answer(self) -> Ready | Failed:
        """Its Ready (or why it cannot load), unless the process that would answer ends first."""
        watched = self._process.pid if self._process is not None else self.supervisor_pid
        try:
            pidfd = os.pidfd_open(watched) if watched is not None else None
        except ProcessLookupError:
            return Failed("the supervisor exited before the analysis process was ready")
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        if pidfd is not None:
            loop.add_reader(pidfd, lambda: ended.done() or ended.set_result(None))
        answer = asyncio.ensure_future(self.call(Hello()))
        try:
            await asyncio.wait({answer, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if pidfd is not None:
                loop.remove_reader(pidfd)
                os.close(pidfd)
            if not answer.done():
                answer.cancel()
        if answer.done():
            return answer.result()
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 5.0)
            return Failed(f"the analysis process exited (code {self._process.exitcode}) before it was ready")
        return Failed("the supervisor exited before the analysis process was ready")

    async def call(self, call) -> Done | Refused | Failed | Ready:
        if self.stopped is not None:
            raise AnalysisUnavailable(self.stopped)
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            await self._socket.send(encoder.encode(Request(request_id, call)))
            return await future
        finally:
            self._pending.pop(request_id, None)

    async def load_adapter(self, name: str, folder: str) -> None:
        """Make a peft folder's LoRA adapter analysable under `name` (the engine core loads its own
        copy). ValueError with the one-line reason when the folder or the name is refused."""
        await self._adapters_call(LoadAdapter(name, str(folder)))

    async def unload_adapter(self, name: str) -> None:
        """No new analysis may name it from now on; those running finish with it. ValueError when
        no adapter of that name is loaded."""
        await self._adapters_call(UnloadAdapter(name))

    async def adapters(self) -> list[str]:
        """The names of the adapters an analysis may apply."""
        return json.loads((await self._adapters_call(ListAdapters())).body)["adapters"]

    async def _adapters_call(self, call) -> Done:
        answer = await self.call(call)
        if isinstance(answer, Refused):
            raise ValueError(answer.message)
        if isinstance(answer, Failed):
            raise AnalysisUnavailable(answer.message)
        return answer

    async def _read(self) -> None:
        while True:
            reply = replies.decode(await self._socket.recv())
            future = self._pending.get(reply.id)
            if future is not None and not future.done():  # else its client left
                future.set_result(reply.answer)

    def _on_exit(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        self._fail_all(STOPPED)

    def _fail_all(self, reason: str) -> None:
        self.stopped = reason
        for future in self._pending.values():
            if not future.done():
                future.set_exception(AnalysisUnavailable(reason))

    async def stop(self) -> None:
        self._fail_all("the server is shutting down")
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._reader is not None:
            self._reader.cancel()
        if self._socket is not None:
            self._socket.close()
            self._context.term()
            self._socket = None
        process, self._process = self._process, None
        if process is not None:
            # Nothing to drain: open responses were finished before the lifespan ends, and it
            # ignores SIGTERM (its parent owns shutdown).
            process.kill()
            await asyncio.to_thread(process.join)
        if self.spawn is not None and self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
