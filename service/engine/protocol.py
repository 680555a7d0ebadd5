"""Messages between the HTTP process and the engine-core process, and their encoding.

ZeroMQ carries them (PUSH/PULL over a Unix socket, one each way per HTTP process; with
--api-servers N the core routes each request's outputs to the process that sent it, as vLLM's
--api-server-count does) and msgspec's MessagePack
encodes them, as vLLM's EngineCore client does: both are well kept, and msgspec encodes the
engine's own dataclasses as they are, with no pickle on either side. One CoreOutput per engine
step carries every request's new token ids at once, so the HTTP side wakes once per step.
bench/bench_ipc.py measures this against multiprocessing's pickling pipe.
"""

from __future__ import annotations

import msgspec

from service.engine.types import CoreStep, GenerationRequest


class AddRequests(msgspec.Struct, tag=True):
    """Requests to be prefilled together (the prompts of one HTTP call)."""

    requests: list[GenerationRequest]
    client: int = 0  # the HTTP process that sent them: their outputs go to it alone


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class Hello(msgspec.Struct, tag=True):
    """An HTTP process (re)started: the core drops what an earlier one of that number had asked
    for, and answers CoreReady."""

    client: int


class Shutdown(msgspec.Struct, tag=True):
    """Take no new work; with drain, finish what runs (cancelling it after timeout seconds)."""

    drain: bool
    timeout: float | None = None


class AdapterCommand(msgspec.Struct, tag=True):
    """Load a LoRA adapter (a peft folder) under a name, or unload it (folder None)."""

    ticket: int  # the sender's number for it: the answer carries it back
    name: str
    folder: str | None
    client: int = 0


class CoreReady(msgspec.Struct, tag=True):
    pid: int
    adapters: list[str] = []  # the LoRA adapters requests may name


class AdapterNames(msgspec.Struct, tag=True):
    """The adapters requests may name, sent to every HTTP process after each AdapterCommand;
    the sender's answer (its client and ticket) with the refusal's reason, if any."""

    names: list[str]
    client: int = -1
    ticket: int = -1
    error: str | None = None


class CoreOutput(msgspec.Struct, tag=True):
    step: CoreStep


class CoreExit(msgspec.Struct, tag=True):
    """The core's last message before its process ends."""

    reason: str


ToCore = AddRequests | AbortRequests | Hello | Shutdown | AdapterCommand
FromCore = CoreReady | CoreOutput | CoreExit | AdapterNames

encoder = msgspec.msgpack.Encoder()
to_core = msgspec.msgpack.Decoder(ToCore)
from_core = msgspec.msgpack.Decoder(FromCore)
