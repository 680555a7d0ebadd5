"""The engine core's memory under a long mixed load: its native caches bounded, its heap trimmed.

A load of ever-changing shapes (prompts of every length, batches of every size) grew the core's
resident memory by ~900 MB over 20 minutes and it was still rising (docs/performance.md, "Memory
under a long mixed load"). Python objects were not it (tracemalloc: < 1 MB). Two native causes:

- oneDNN primitives for every input shape. Each packed product (model/linear.py) builds a
  primitive per row count, kept twice: in ideep's LRU cache (LRU_CACHE_CAPACITY) and in oneDNN's
  own (ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1,024 entries each by default, ~0.55 MB per row count
  for the pair: ~570 MB once a load has shown enough shapes. The core caps both at
  PRIMITIVE_CACHE_CAPACITY, which still holds every decode shape (a few per batch size) beside
  the recent prefill lengths; a prefill at an evicted length rebuilds its primitives, which it
  had to do anyway at the default capacity once the shapes outnumbered it.
- glibc's heap: freed activations of every size stay in its arenas (it returns only the free top
  of a heap to the system), so the free-but-held part kept growing with new sizes. malloc_trim(0)
  hands every free page back; a thread does it every TRIM_EVERY_S seconds, idle or not.

Either cache capacity can be set in the environment instead (the core keeps what it finds there),
and GPT2_CORE_HEAP_TRIM_S the trimming period (0: never).

GPT2_CORE_MEMORY_LOG=PATH (a debugging aid) makes the core append one JSON line to PATH every
GPT2_CORE_MEMORY_LOG_S seconds (default 30): its resident memory and glibc's arena statistics
(`mallinfo2`: bytes in use, free inside the arenas, in mmapped blocks) and the trims since the
previous line (how many, their total and longest milliseconds); with
GPT2_CORE_TRACEMALLOC=1 also the Python allocation sites that grew most since the previous line
(tracemalloc slows the core's Python code).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

PRIMITIVE_CACHE_CAPACITY = 256
PRIMITIVE_CACHES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")  # ideep's, oneDNN's
TRIM_EVERY_S = 10.0
# What the trimmer did since the debug log's previous line: trims, their total and longest time.
trims = {"count": 0, "total_ms": 0.0, "max_ms": 0.0}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (malloc_trim is glibc's), else None (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "malloc_trim"):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    return libc


LIBC = _glibc()


def bound_primitive_caches(capacity: int = PRIMITIVE_CACHE_CAPACITY) -> dict[str, str]:
    """Cap oneDNN's primitive caches unless the environment already does; returns what is in
    force. Both are read when the first primitive is built: call this before the model loads."""
    for name in PRIMITIVE_CACHES:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in PRIMITIVE_CACHES}


def trim_heap() -> bool:
    """Give every free page of glibc's arenas back to the system; False where there is no glibc."""
    if LIBC is None:
        return False
    LIBC.malloc_trim(0)
    return True


def start_heap_trimmer(every_s: float = TRIM_EVERY_S, trim: Callable[[], bool] = trim_heap,
                       stop: threading.Event | None = None) -> threading.Thread | None:
    """A daemon thread that trims the heap every `every_s` seconds until `stop` is set (None
    without glibc). ctypes lets go of the GIL during the call; glibc locks the arenas one at a
    time while it trims them."""
    if LIBC is None and trim is trim_heap:
        return None
    stop = stop or threading.Event()

    def run() -> None:
        while not stop.wait(every_s):
            started = time.perf_counter()
            trim()
            took = (time.perf_counter() - started) * 1000
            trims.update(count=trims["count"] + 1, total_ms=trims["total_ms"] + took, max_ms=max(trims["max_ms"], took))

    thread = threading.Thread(target=run, name="heap-trim", daemon=True)
    thread.start()
    return thread


def rss_bytes(pid: int | None = None) -> int:
    with open(f"/proc/{pid or os.getpid()}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def heap_stats() -> dict[str, int]:
    """glibc's totals over every arena: in use, free but held, and mmapped blocks (bytes)."""
    if LIBC is None or not hasattr(LIBC, "mallinfo2"):
        return {}
    info = LIBC.mallinfo2()
    return {"arena": info.arena, "in_use": info.uordblks, "free_in_arenas": info.fordblks, "mmapped": info.hblkhd}


def bound_core_memory() -> None:
    """What the engine core process calls before it loads the model."""
    caches = bound_primitive_caches()
    every = float(os.environ.get("GPT2_CORE_HEAP_TRIM_S", TRIM_EVERY_S))
    trimming = every > 0 and start_heap_trimmer(every) is not None
    log.info("engine core memory: oneDNN primitive caches %s; heap %s", caches,
             f"trimmed every {every:g} s" if trimming else "not trimmed")
    start_debug_log()


def start_debug_log() -> None:
    path = os.environ.get("GPT2_CORE_MEMORY_LOG")
    if not path:
        return
    every = float(os.environ.get("GPT2_CORE_MEMORY_LOG_S", "30"))
    traced = os.environ.get("GPT2_CORE_TRACEMALLOC") == "1"
    if traced:
        tracemalloc.start(8)
    thread = threading.Thread(target=_log_forever, args=(Path(path), every, traced), name="memory-log", daemon=True)
    thread.start()
    log.info("engine core memory log: %s every %.0f s%s", path, every, " with tracemalloc" if traced else "")


def _log_forever(path: Path, every: float, traced: bool) -> None:
    started = time.monotonic()
    previous = tracemalloc.take_snapshot() if traced else None
    while True:
        time.sleep(every)
        line: dict = {"t": round(time.monotonic() - started, 1), "rss": rss_bytes(), **heap_stats(), "trims": dict(trims)}
        trims.update(count=0, total_ms=0.0, max_ms=0.0)
        if traced:
            snapshot = tracemalloc.take_snapshot()
            line["python_traced"] = tracemalloc.get_traced_memory()[0]
            line["python_growth"] = [
                {"site": str(stat.traceback), "size_diff": stat.size_diff, "count_diff": stat.count_diff}
                for stat in snapshot.compare_to(previous, "traceback")[:8]]
            previous = snapshot
        with path.open("a") as out:
            out.write(json.dumps(line) + "\n")
