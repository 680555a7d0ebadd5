"""The engine core's memory bounds (service/engine/memory.py): oneDNN's primitive caches capped, so
a load of ever-new row counts stops adding primitives; glibc's free pages handed back by the
trimmer. Each measurement runs in a fresh interpreter: the caches are sized at their first use,
and the heap must be this test's alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from service.engine import memory
from tests.conftest import REPO, TEST_DEVICE

glibc = pytest.mark.skipif(memory.LIBC is None or memory.heap_stats() == {}, reason="needs glibc's malloc_trim and mallinfo2")

# 200 packed products at 200 different row counts; prints how much glibc's in-use bytes grew.
SHAPES = """
import json, sys, torch
from service.engine.memory import bound_primitive_caches, heap_stats
if sys.argv[1] != "default":
    bound_primitive_caches(int(sys.argv[1]))
torch.set_num_threads(1)
from model.linear import linear, onednn_serves, pack
if not onednn_serves(torch.device("cpu"), torch.float32):
    print(json.dumps(None)); sys.exit()
weight, bias = torch.randn(256, 128), torch.randn(256)
packed = pack(weight)
before = heap_stats()["in_use"]
for rows in range(1, 201):
    linear(torch.randn(rows, 128), weight, bias, packed)
print(json.dumps(heap_stats()["in_use"] - before))
"""

# Fragments the heap (blocks below the mmap threshold, all freed but the last, which pins the top
# of the heap so glibc cannot give it back by itself), then trims; prints RSS at each point.
FRAGMENT = """
import ctypes, json
from service.engine.memory import LIBC, rss_bytes, trim_heap
LIBC.malloc.restype = ctypes.c_void_p
LIBC.free.argtypes = [ctypes.c_void_p]
blocks = [LIBC.malloc(64 * 1024) for _ in range(2000)]
for block in blocks:
    ctypes.memset(block, 1, 64 * 1024)
filled = rss_bytes()
for block in blocks[:-1]:
    LIBC.free(block)
freed = rss_bytes()
trim_heap()
print(json.dumps([filled, freed, rss_bytes()]))
"""


def run_python(code: str, *args: str) -> object:
    env = {k: v for k, v in os.environ.items() if k not in memory.PRIMITIVE_CACHES}
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.splitlines()[-1])


# The CPU build's oneDNN (torch's CPU wheel, what CPU serving runs): the CUDA lane's torch is a CUDA
# build whose CPU products grew the heap by 8 MB over these 200 shapes (torch 2.11.0+cu130 on a Xeon).
@pytest.mark.skipif(TEST_DEVICE == "cuda", reason="the CPU wheel's oneDNN caches: the CPU lane's subject")
@glibc
def test_capped_primitive_caches_stop_growing_with_new_shapes():
    default = run_python(SHAPES, "default")
    if default is None:
        pytest.skip("this torch build serves no packed oneDNN products")
    capped = run_python(SHAPES, "16")
    # ~0.5 MB per row count at oneDNN's default capacities (1,024 each): 200 shapes ~100 MB;
    # capped at 16, what stays is 16 primitives per cache.
    assert default > 50 * 2**20, default
    assert capped < 16 * 2**20, capped


@glibc
def test_trim_gives_free_heap_pages_back():
    filled, freed, trimmed = run_python(FRAGMENT)
    mb = 2**20
    assert filled - trimmed > 100 * mb, (filled, freed, trimmed)
    assert freed - trimmed > 100 * mb, "glibc gave the pages back without a trim: the test no longer fragments"


def test_environment_capacities_are_kept(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert memory.bound_primitive_caches(32) == {"LRU_CACHE_CAPACITY": "7", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "32"}


def test_trimmer_trims_repeatedly():
    calls, stop = threading.Semaphore(0), threading.Event()
    thread = memory.start_heap_trimmer(every_s=0.01, trim=lambda: calls.release() or True, stop=stop)
    try:
        assert all(calls.acquire(timeout=30) for _ in range(3))
    finally:
        stop.set()
        thread.join(timeout=30)
