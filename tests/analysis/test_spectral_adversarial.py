"""`fast` against float64 on thousands of attention matrices, and on inputs built to fool it.

The references are float64 `matrix_norm(ord=2)` of the same float32 matrices, on the CPU (LAPACK),
so they do not depend on the device under test. The tolerance is the same on CPU and CUDA: the
certificate bounds the value from both sides in arithmetic without cancellation (see
model/spectral.py), whatever the device's rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

from model.spectral import FAST_RTOL, _perron_upper_bound, top_singular_fast
from tests.analysis.test_spectral import FAST_TOLERANCE, attention_like, causal_softmax

# Sizes 1 to 1,024, many small matrices and few large ones: ~2,500 matrices, seconds on 2 cores.
COUNTS = {1: 64, 2: 64, 3: 64, 5: 96, 8: 128, 13: 128, 17: 128, 31: 160, 48: 160, 64: 128, 97: 96,
          130: 64, 200: 32, 320: 16, 512: 6, 1024: 2}


def reference(matrices: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_norm(matrices.double().cpu(), ord=2)


def relative_errors(actual: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    expected = reference(matrices)
    return (actual.double().cpu() - expected).abs() / expected


def close_sinks(n: int, count: int, seed: int) -> torch.Tensor:
    """Rows split between two "attention sinks", columns 0 and 1, whose weights differ by a
    relative 1e-6 to 1e-1: two top singular values as close as that."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(count, n, n, generator=generator)
    split = torch.rand(count, n, 1, generator=generator) < 0.5  # [B, n, 1]: which sink a row uses
    ratio = 10 ** -torch.empty(count, 1, 1).uniform_(1.0, 6.0, generator=generator)  # [B, 1, 1]
    logits[:, :, :1] += torch.where(split, 8.0, 0.0)
    logits[:, :, 1:2] += torch.where(split, 0.0, 8.0 + torch.log1p(-ratio))
    return causal_softmax(logits)


def one_hot_rows(n: int, count: int, seed: int) -> torch.Tensor:
    """Rows that underflow to exact one-hots: AᵀA splits into blocks that do not touch."""
    return attention_like(n, 200.0, count, seed)


def families(n: int, count: int, seed: int) -> dict[str, torch.Tensor]:
    scales = torch.logspace(-2, math.log10(30.0), count)[:, None, None]  # flat to sharp
    logits = torch.randn(count, n, n, generator=torch.Generator().manual_seed(seed))
    return {
        "attention, flat to sharp": causal_softmax(logits * scales),
        "two close sinks": close_sinks(n, max(count // 2, 1), seed + 1),
        "one-hot rows": one_hot_rows(n, max(count // 4, 1), seed + 2),
    }


@pytest.mark.parametrize("n", list(COUNTS))
def test_fast_matches_float64_on_thousands_of_attention_matrices(n: int, device) -> None:
    for name, matrices in families(n, COUNTS[n], seed=n).items():
        matrices = matrices.to(device)
        errors = relative_errors(top_singular_fast(matrices).sigma, matrices)
        assert errors.max() < FAST_TOLERANCE, (name, n, errors.argmax().item(), errors.max().item())


def hidden_top(n: int, gap: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix whose top right singular vector v1 is orthogonal to the all-ones vector, to the
    column sums and to 14 given warm-start rows (v2..v15), which span a subspace that AᵀA maps
    into itself: a Krylov method started there never sees v1, and its residual certifies σ2."""
    generator = torch.Generator().manual_seed(seed)
    ones = torch.ones(n, 1, dtype=torch.float64) / math.sqrt(n)
    # Orthonormal bases whose first column is orthogonal to the all-ones vector.
    u, v = (torch.linalg.qr(torch.cat([ones, torch.randn(n, n - 1, generator=generator, dtype=torch.float64)], 1)).Q for _ in range(2))
    u, v = u.roll(-1, dims=1), v.roll(-1, dims=1)  # the ones direction goes last
    sigma = torch.linspace(1.0, 0.1, n, dtype=torch.float64)
    sigma[0] = sigma[1] * (1 + gap)
    matrix = (u * sigma) @ v.T
    warm_start = v[:, 1:15].T.flip(0)  # [14, n], best last
    return matrix.float(), warm_start.float()


@pytest.mark.parametrize("gap", [1e-3, 1e-2, 1e-1])
def test_a_start_block_that_misses_the_top_singular_vector_is_not_certified(gap: float, device) -> None:
    n = 130
    matrix, warm_start = hidden_top(n, gap, seed=int(1 / gap))
    matrix, warm_start = matrix[None].to(device), warm_start[None].to(device)
    top = top_singular_fast(matrix, warm_start=warm_start)
    assert relative_errors(top.sigma, matrix).max() < FAST_TOLERANCE


def test_the_perron_bound_is_an_upper_bound_whatever_the_vector(device) -> None:
    # The certificate's one claim: for A ≥ 0, the bound is ≥ σ_max² from any vector, including
    # vectors of the wrong singular value, random ones, and ones with zeros.
    generator = torch.Generator().manual_seed(5)
    for n in (2, 17, 64, 200):
        matrices = torch.cat([families(n, 16, seed=50 + n)[name] for name in ("attention, flat to sharp", "one-hot rows")])
        matrices = matrices.to(device)
        sigma_squared = reference(matrices) ** 2
        second = torch.linalg.svd(matrices.double().cpu()).Vh[:, min(1, n - 1)].float()  # [B, n]
        for vectors in (second, torch.rand(len(matrices), n, generator=generator), torch.zeros(len(matrices), n)):
            bound = _perron_upper_bound(matrices, vectors.to(device)).cpu()
            assert (bound >= sigma_squared * (1 - 1e-6)).all(), n


def test_the_perron_bound_meets_the_value_at_the_top_vector(device) -> None:
    # ...and is tight enough near the top singular vector to certify, or `fast` would be LAPACK.
    matrices = attention_like(300, 2.0, 8, seed=9).to(device)
    top = torch.linalg.svd(matrices.double().cpu()).Vh[:, 0].float().to(device)  # [B, n]
    bound = _perron_upper_bound(matrices, top).cpu()
    assert (bound <= reference(matrices) ** 2 * (1 + FAST_RTOL)).all()
