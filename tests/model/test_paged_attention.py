"""CUDA decode's "paged" attention (model/paged_attention.py): the Triton kernel reading each
row's keys through its block table gives the gather path's attention and logits (the check
itself: tests/model/paged_check.py). On the CPU it runs on Triton's interpreter, in a
subprocess, since the interpreter is chosen when Triton is first imported."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from model.kv_cache import KVCache
from model.paged_attention import check_decode_attention
from tests.conftest import REPO, TINY

triton = pytest.importorskip("triton")


def test_paged_decode_agrees_with_the_gather_path(device):
    if device.type == "cuda":
        from tests.model import paged_check  # noqa: PLC0415

        assert paged_check.main(["cuda"]) == 0
        return
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("Triton's interpreter before 3.9 fails under NumPy 2 (a scalar read as an array)")
    done = subprocess.run([sys.executable, "-m", "tests.model.paged_check", "cpu"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "agrees" in done.stdout


def test_decode_attention_is_checked_by_name_and_device(monkeypatch):
    with pytest.raises(ValueError, match="one of gather, paged, got 'flash'"):
        KVCache(TINY, 2, 64, decode_attention="flash")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA and Triton"):
        check_decode_attention("paged", torch.device("cpu"))
    check_decode_attention("gather", torch.device("cpu"))


def test_the_setting_reaches_the_engine_and_is_refused_off_cuda():
    from pydantic import ValidationError  # noqa: PLC0415

    from service.app import core_config  # noqa: PLC0415
    from service.settings import Settings  # noqa: PLC0415

    assert core_config(Settings(device="cuda", decode_attention="paged"), 128, 50256).engine.decode_attention == "paged"
    assert core_config(Settings(), 128, 50256).engine.decode_attention == "gather"
    with pytest.raises(ValidationError, match="needs --device cuda"):
        Settings(decode_attention="paged")
