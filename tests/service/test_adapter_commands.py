"""Adapter commands as one HTTP process of several sends them (service/http/adapter_commands.py):
the core's answer reaches the process and command that asked, its names reach every process, and
a core that goes away fails what still waits. Driven with the core's messages by hand, no core."""

from __future__ import annotations

import asyncio

import pytest

from service.engine.protocol import AdapterCommand, AdapterNames
from service.http.adapter_commands import AdapterCommands


def test_an_answer_reaches_the_command_that_asked_and_names_reach_every_process():
    async def main():
        sent: list[AdapterCommand] = []
        commands = AdapterCommands(sent.append, client_index=1)
        loading = asyncio.ensure_future(commands.run("comedies", "/adapters/comedies", timeout=30))
        await asyncio.sleep(0)
        [command] = sent
        assert (command.name, command.folder, command.client) == ("comedies", "/adapters/comedies", 1)
        # Another process's command with the same ticket number: its names count, its answer is not ours.
        commands.take(AdapterNames(["tragedies"], 0, command.ticket, "not ours"))
        await asyncio.sleep(0)
        assert commands.names == ["tragedies"] and not loading.done()
        commands.take(AdapterNames(["tragedies", "comedies"], 1, command.ticket, None))
        await asyncio.wait_for(loading, 5)
        assert commands.names == ["tragedies", "comedies"]

        refused = asyncio.ensure_future(commands.run("broken", "/adapters/broken", timeout=30))
        await asyncio.sleep(0)
        commands.take(AdapterNames(commands.names, 1, sent[-1].ticket, "no adapter_config.json"))
        with pytest.raises(ValueError, match="no adapter_config.json"):
            await asyncio.wait_for(refused, 5)

    asyncio.run(main())


def test_a_core_that_goes_away_fails_every_waiting_command():
    async def main():
        commands = AdapterCommands(lambda command: None, client_index=0)
        waiting = [asyncio.ensure_future(commands.run(name, None, timeout=30)) for name in ("a", "b")]
        await asyncio.sleep(0)
        commands.fail("the engine core process died")
        for command in waiting:
            with pytest.raises(RuntimeError, match="died"):
                await asyncio.wait_for(command, 5)

    asyncio.run(main())
