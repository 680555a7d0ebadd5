"""LoRA adapters loaded and unloaded at run time, as the HTTP process asks the engine core: each
command is sent with a ticket and its answer awaited by it; the names requests may use are the
core's last word (it tells every HTTP process after each load or unload, whoever asked).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from service.engine.protocol import AdapterCommand, AdapterNames


class AdapterCommands:
    def __init__(self, send: Callable[[AdapterCommand], None], client_index: int) -> None:
        """`send` takes a command to the core; `client_index` is this HTTP process's number, which
        the core's answers name."""
        self._send = send
        self._client_index = client_index
        self.names: list[str] = []  # the adapters requests may name
        self._answers: dict[int, asyncio.Future] = {}
        self._tickets = itertools.count()

    async def run(self, name: str, folder: str | None, timeout: float) -> None:
        """Load the peft folder as adapter `name`, or unload it (folder None). Raises ValueError
        with the core's one-line reason when it refuses."""
        ticket = next(self._tickets)
        answer = asyncio.get_running_loop().create_future()
        self._answers[ticket] = answer
        self._send(AdapterCommand(ticket, name, folder, self._client_index))
        try:
            error = await asyncio.wait_for(answer, timeout)
        finally:
            self._answers.pop(ticket, None)
        if error is not None:
            raise ValueError(error)

    def take(self, message: AdapterNames) -> None:
        """The core's names after a load or unload, and, to the process that asked, its answer."""
        self.names = list(message.names)
        answer = self._answers.get(message.ticket) if message.client == self._client_index else None
        if answer is not None and not answer.done():
            answer.set_result(message.error)

    def fail(self, reason: str) -> None:
        """The core is gone: every command still waiting fails with `reason`."""
        for answer in self._answers.values():
            if not answer.done():
                answer.set_exception(RuntimeError(reason))
