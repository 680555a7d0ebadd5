"""The start-up heap is frozen out of garbage collection (service/engine/gc_heap.py), in every
process of a real server, while what is made afterwards is still collected."""

from __future__ import annotations

import gc
import re
import weakref

import pytest

from service.engine.gc_heap import freeze_startup_heap
from tests.service.live import live_server


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    """An unreachable reference cycle (only the collector frees it); a weak reference to it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # the rest of the test session collects as before


def test_garbage_made_before_is_collected_what_survives_is_frozen_and_later_garbage_still_goes(unfrozen):
    kept = Node()
    before = cycle()
    frozen = freeze_startup_heap("test")
    assert before() is None  # collected before freezing: garbage is never frozen
    # (Not equal to the count read later: a frozen object freed by its reference count leaves.)
    assert frozen > 0 and gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects())  # frozen: no generation lists it
    after = cycle()
    assert after() is not None
    gc.collect()
    assert after() is None  # made while serving: collected as before


@pytest.mark.slow
def test_every_server_process_freezes_its_startup_heap(tiny_model_dir):
    with live_server(tiny_model_dir) as server:
        assert server.get("/health").status_code == 200
        log = server.log()
    for process in ("HTTP", "engine core", "analysis"):
        assert re.search(rf"{process}: [1-9][0-9]* start-up objects frozen out of garbage collection", log), log[-3000:]
