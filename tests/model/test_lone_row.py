"""A lone row's product gets the batched rows' bits whatever oneDNN's kernel for one row does
(model/lone_row.py): where that kernel sums in another order, the row runs as two; where it sums
the same way, the row runs alone (no second row's cost). The kernels below stand in for oneDNN's
on a CPU where its lone-row kernel differs; the real kernel is checked in
tests/engine/test_invariance_fuzz.py."""

from __future__ import annotations

import math

import pytest
import torch

import model.lone_row
from model.linear import linear, onednn_serves, pack

pytestmark = pytest.mark.skipif(not onednn_serves(torch.device("cpu"), torch.float32), reason="oneDNN does not serve here")
REAL = torch.ops.mkldnn._linear_pointwise


def lone_rows_nudged(when=lambda: True):
    """oneDNN's product, but a lone row's outputs one float step up (another summation order's
    last bits), while `when()`."""
    def kernel(x, packed, bias, post_op, scalars, algorithm):
        y = REAL(x, packed, bias, post_op, scalars, algorithm)
        return torch.nextafter(y, torch.full_like(y, math.inf)) if x.numel() == x.shape[-1] and when() else y
    return kernel


@pytest.fixture
def product(monkeypatch):
    """A fresh probe memory, the threads restored, and a 3,072-input product: (x [8, in], weight, bias, packed)."""
    monkeypatch.setattr(model.lone_row, "_agrees", {})
    threads = torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(768, 3072, generator=generator) * 0.02, torch.randn(768, generator=generator)
    yield torch.randn(8, 3072, generator=generator), weight, bias, pack(weight)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("gelu", [False, True])
def test_a_lone_row_gets_the_batched_bits_where_the_one_row_kernel_sums_otherwise(product, monkeypatch, gelu):
    x, weight, bias, packed = product
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lone_rows_nudged())
    batched = linear(x, weight, bias, packed, gelu)
    for row in (0, 5):
        assert torch.equal(linear(x[row : row + 1], weight, bias, packed, gelu)[0], batched[row])
        assert torch.equal(linear(x[row], weight, bias, packed, gelu), batched[row])  # [in] -> [out]


def test_a_lone_row_runs_alone_where_the_one_row_kernel_agrees(product, monkeypatch):
    x, weight, bias, packed = product
    rows_seen = []

    def row_by_row(x, packed, bias, post_op, scalars, algorithm):
        # Each row through the one-row kernel: the same bits alone and in any batch, by construction.
        rows_seen.append(x.shape[0])
        return torch.cat([REAL(x[i : i + 1], packed, bias, post_op, scalars, algorithm) for i in range(x.shape[0])])

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", row_by_row)
    linear(x[:1], weight, bias, packed)  # probed here
    rows_seen.clear()
    assert torch.equal(linear(x[3:4], weight, bias, packed), REAL(x[3:4], packed, bias, "none", [], ""))
    assert rows_seen == [1]  # one call, of the one row: not run as two


def test_the_probe_is_per_thread_count(product, monkeypatch):
    """A kernel whose lone rows sum otherwise with 2 threads only: probed with 1 thread it
    agrees, and with 2 the row must still get the batched bits."""
    x, weight, bias, packed = product
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lone_rows_nudged(when=lambda: torch.get_num_threads() > 1))
    torch.set_num_threads(1)
    assert torch.equal(linear(x[2:3], weight, bias, packed)[0], linear(x, weight, bias, packed)[2])
    torch.set_num_threads(2)
    assert torch.equal(linear(x[2:3], weight, bias, packed)[0], linear(x, weight, bias, packed)[2])


def test_the_probe_leaves_the_global_random_state_alone(product):
    x, weight, bias, packed = product
    before = torch.get_rng_state()
    linear(x[:1], weight, bias, packed)
    assert model.lone_row._agrees  # it probed
    assert torch.equal(torch.get_rng_state(), before)
