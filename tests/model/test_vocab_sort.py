"""model/vocab_sort.py gives torch's stable sort to the bit: values (signed zeros where they
were) and indices, ties in either order, on rows with many ties, infinities and signed zeros."""

from __future__ import annotations

import pytest
import torch

from model.vocab_sort import sort_ascending


def rows() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    normal = torch.randn(5, 50257, generator=generator)
    tied = (torch.randn(3, 4099, generator=generator) * 4).round() / 4  # a few dozen distinct values, each many times
    special = torch.tensor([[0.0, -0.0, float("-inf"), 1.5, -0.0, float("inf"), 0.0, -2.5, float("-inf"), 1.5, -1e-45, 1e-45,
                             3.4e38, -3.4e38, 0.0]])
    masked = normal[:2].clone()
    masked[masked < 1.0] = float("-inf")  # top-k's mask: most of the row -inf
    return {"normal": normal, "tied": tied, "special": special, "masked": masked, "one row": normal[:1], "tiny": tied[:, :7]}


@pytest.mark.parametrize("name", list(rows()))
@pytest.mark.parametrize("high_first", [False, True], ids=["ties low index first", "ties high index first"])
def test_the_order_is_torchs_stable_sort_to_the_bit(name, high_first):
    values = rows()[name]
    if high_first:
        descending, descending_index = values.sort(dim=-1, descending=True, stable=True)
        expected, expected_index = descending.flip(-1), descending_index.flip(-1)
    else:
        expected, expected_index = values.sort(dim=-1, stable=True)
    got, index = sort_ascending(values, high_first)
    assert torch.equal(index, expected_index)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # bits: -0.0 stays where it was


def test_other_dtypes_take_torchs_sort():
    values = rows()["tied"].to(torch.float16)
    got, index = sort_ascending(values, True)
    descending, descending_index = values.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(index, descending_index.flip(-1)) and torch.equal(got, descending.flip(-1))
