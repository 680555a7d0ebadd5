"""Muon's orthogonalisation in float32: the same result as torch's bfloat16 one within
bfloat16's rounding, swapped in only inside `muon_in_float32`, and a named failure if a torch
upgrade moves the private function it replaces."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.optim import _muon

from weights import trainer
from weights.trainer import muon_in_float32, orthogonalize_float32

COEFFICIENTS = (3.4445, -4.775, 2.0315)
BFLOAT16_TOLERANCE = 0.02  # measured max |difference| 0.005 on entries of size ~0.27


def test_torch_still_has_the_function_we_swap():
    assert hasattr(_muon, "_zeropower_via_newtonschulz"), "torch.optim._muon._zeropower_via_newtonschulz moved: update weights/trainer.muon_in_float32"
    parameters = list(inspect.signature(_muon._zeropower_via_newtonschulz).parameters)
    assert parameters == ["grad", "ns_coefficients", "ns_steps", "eps"], parameters
    assert "_zeropower_via_newtonschulz(" in inspect.getsource(_muon._single_tensor_muon)


@pytest.mark.parametrize("shape", [(64, 192), (192, 64)])
def test_float32_orthogonalisation_matches_torchs(shape):
    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    theirs = _muon._zeropower_via_newtonschulz(grad, COEFFICIENTS, 5, 1e-7).float()
    ours = orthogonalize_float32(grad, COEFFICIENTS, 5, 1e-7)
    assert ours.dtype == torch.float32 and ours.shape == grad.shape
    torch.testing.assert_close(ours, theirs, atol=BFLOAT16_TOLERANCE, rtol=0)
    # Singular values pushed towards 1 (the quintic leaves them in about [0.7, 1.2]).
    singular = torch.linalg.svdvals(ours)
    assert 0.6 < singular.min() and singular.max() < 1.3


def test_swap_is_scoped_to_the_block():
    original = _muon._zeropower_via_newtonschulz
    with muon_in_float32():
        assert _muon._zeropower_via_newtonschulz is orthogonalize_float32
    assert _muon._zeropower_via_newtonschulz is original
    with pytest.raises(RuntimeError), muon_in_float32():
        raise RuntimeError
    assert _muon._zeropower_via_newtonschulz is original


def test_a_muon_step_inside_the_block_orthogonalises_in_float32(monkeypatch):
    shapes = []

    def spy(grad, *rest):
        shapes.append(grad.shape)
        return orthogonalize_float32(grad, *rest)

    monkeypatch.setattr(trainer, "orthogonalize_float32", spy)
    weight = torch.nn.Parameter(torch.randn(32, 96, generator=torch.Generator().manual_seed(1)))
    weight.grad = torch.randn(32, 96, generator=torch.Generator().manual_seed(2))
    with muon_in_float32():
        torch.optim.Muon([weight], lr=0.01).step()
    assert shapes == [(32, 96)]
