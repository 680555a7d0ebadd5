"""service/http/sse.py: keep-alive comments while a stream waits for its first event, none after."""

from __future__ import annotations

import asyncio

from fastapi.sse import KEEPALIVE_COMMENT

from service.http.sse import keepalive_until_first

INTERVAL = 0.01


async def gated(first: asyncio.Event, second: asyncio.Event, closed: list[bool]):
    try:
        await first.wait()
        yield b"data: 1\n\n"
        await second.wait()
        yield b"data: 2\n\n"
    finally:
        closed.append(True)


def test_pings_while_the_first_event_waits_then_events_pass_through_unpinged():
    async def scenario():
        first, second, closed = asyncio.Event(), asyncio.Event(), []
        stream = keepalive_until_first(gated(first, second, closed), INTERVAL)
        assert [await anext(stream), await anext(stream)] == [KEEPALIVE_COMMENT] * 2  # gated: nothing else can come
        first.set()
        while (chunk := await anext(stream)) == KEEPALIVE_COMMENT:
            pass
        assert chunk == b"data: 1\n\n"
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(INTERVAL * 20)
        assert not waiting.done()  # the gap after the first event is not filled with pings
        second.set()
        assert await waiting == b"data: 2\n\n"
        assert [c async for c in stream] == []
        assert closed == [True]

    asyncio.run(scenario())


def test_closing_while_waiting_for_the_first_event_ends_the_source():
    async def scenario():
        closed = []
        stream = keepalive_until_first(gated(asyncio.Event(), asyncio.Event(), closed), INTERVAL)
        assert await anext(stream) == KEEPALIVE_COMMENT
        await stream.aclose()
        await asyncio.sleep(0)  # the cancelled source runs its finally
        assert closed == [True]

    asyncio.run(scenario())


def test_a_source_that_ends_at_once_gives_nothing():
    async def empty():
        return
        yield

    async def scenario():
        return [c async for c in keepalive_until_first(empty(), INTERVAL)]

    assert asyncio.run(scenario()) == []
