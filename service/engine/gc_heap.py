"""Keep the start-up heap out of the garbage collector's full collections.

Every process of the server (HTTP, engine core, analysis) imports torch, FastAPI, pydantic and
more: ~170,000-340,000 objects alive before the first request, none of which will ever be
garbage. CPython's oldest-generation collection walks every tracked object, so while serving,
whenever enough objects have survived to trigger it, that process stops for the whole walk:
measured 169-240 ms per collection, every few seconds, in the HTTP process under 64 and 256
streams on the 2-core dev machine, during which no stream's tokens were written
(docs/performance.md, "Garbage-collection pauses"). vLLM (`freeze_gc_heap`)
and SGLang (`freeze_gc`) do what this does: collect once, then move what is
left into the permanent generation (`gc.freeze`), which no collection walks again; objects made
while serving are collected as before.
"""

from __future__ import annotations

import atexit
import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap(process: str) -> int:
    """Collect, then freeze what survives; returns the number of objects frozen. Call it once a
    process has loaded what it keeps for its lifetime and before it serves."""
    gc.collect()
    gc.freeze()
    # At exit, back under the collector: the interpreter's last collections free them as before
    # (frozen, some native extensions' objects outlive their module and nanobind reports leaks).
    # Registered anew each call, atexit would run it once per call: unregister first.
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of garbage collection", process, frozen)
    return frozen
