"""σ_max of batches of matrices: exactly by LAPACK, or fast by a block Krylov method on AᵀA.

Both return float32 values computed from float32 matrices. `fast` certifies each value to
FAST_RTOL / 2 relative (see `top_singular_fast`); a matrix it cannot certify within its
iteration budget, or smaller than LAPACK_BELOW, is handed to LAPACK.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("exact", "fast")

# Residual tolerance on σ_max², so σ_max is certified to 5e-5 relative (the service promises 1e-4).
FAST_RTOL = 1e-4
# Block width. The iteration is bound by reading A from memory, and a pass costs about the
# same for 1 or 16 vectors on CPU, so a wide block buys convergence at almost no cost.
BLOCK = 16
MAX_ITERATIONS = 60
# Restart the subspace when it holds this many blocks: keeps the small eigenproblems small.
MAX_BASIS_BLOCKS = 4
# Below this size LAPACK's full SVD costs less than the iteration's fixed costs (12 heads:
# 3 ms against 7 ms at n = 64, 13 ms against 8 ms at n = 128, on the 2-core CPU here).
LAPACK_BELOW = 96


def spectral_norm(matrices: torch.Tensor, method: str = "fast") -> torch.Tensor:
    """σ_max of each [n, n] matrix of a [..., n, n] batch, as float32 [...]."""
    return top_singular(matrices, method).sigma


@dataclass
class TopSingular:
    sigma: torch.Tensor  # [...] σ_max, float32
    # [..., k, n] orthonormal rows, estimates of the top right singular vectors (best last), to
    # warm-start similar matrices; None when LAPACK answered.
    vectors: torch.Tensor | None


def top_singular(
    matrices: torch.Tensor,
    method: str = "fast",
    column_sums: torch.Tensor | None = None,
    warm_start: torch.Tensor | None = None,
) -> TopSingular:
    """σ_max by `method`; "fast" leaves matrices smaller than LAPACK_BELOW to LAPACK."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    if method == "exact" or matrices.shape[-1] < LAPACK_BELOW:
        return TopSingular(spectral_norm_exact(matrices), None)
    return top_singular_fast(matrices, column_sums, warm_start)


def spectral_norm_exact(matrices: torch.Tensor) -> torch.Tensor:
    """Largest singular value by LAPACK (the document's `svdvals(...).max()`), in float32."""
    *batch, rows, cols = matrices.shape
    flat = matrices.reshape(-1, rows, cols).float()  # [B, n, n]
    if flat.shape[0] == 0:
        return flat.new_zeros(batch)
    # One batched call: the same LAPACK routine per matrix on CPU, and on a GPU one launch for
    # all heads instead of one host round trip per head.
    return torch.linalg.svdvals(flat).amax(dim=-1).reshape(batch)


def spectral_norm_fast(
    matrices: torch.Tensor,
    column_sums: torch.Tensor | None = None,
    rtol: float = FAST_RTOL,
    block: int = BLOCK,
    max_iterations: int = MAX_ITERATIONS,
) -> torch.Tensor:
    """σ_max by a block Krylov method on AᵀA; see `top_singular_fast`."""
    return top_singular_fast(matrices, column_sums, None, rtol, block, max_iterations).sigma


def top_singular_fast(
    matrices: torch.Tensor,
    column_sums: torch.Tensor | None = None,
    warm_start: torch.Tensor | None = None,
    rtol: float = FAST_RTOL,
    block: int = BLOCK,
    max_iterations: int = MAX_ITERATIONS,
) -> TopSingular:
    """σ_max by block Krylov iteration on AᵀA with Rayleigh–Ritz, batched over matrices.

    Each iteration applies A and Aᵀ once to a block of `block` vectors and adds the result to
    the search subspace; θ, the largest Rayleigh quotient of AᵀA on that subspace, only grows
    towards σ_max². A matrix stops when θ's Ritz vector y has ‖AᵀA y − θ y‖ ≤ rtol·θ: then an
    eigenvalue of AᵀA lies within rtol·θ of θ, so sqrt(θ) is within rtol/2 of a singular value.
    The subspace restarts from the top Ritz vectors when it holds MAX_BASIS_BLOCKS blocks.

    Start block: the all-ones vector and the column sums Aᵀ1 (for an attention matrix A·1 = 1,
    so Aᵀ1 = AᵀA·1 is one power step ahead, free when the caller has it already), then the rows
    of `warm_start` [..., k, n] (e.g. the `vectors` of similar matrices: the same head one layer
    down), then seeded random vectors, so the answer does not depend on global RNG state.
    Start vectors only change how soon a matrix is certified, never the certified value.
    """
    *batch, n_rows, n = matrices.shape
    A = matrices.reshape(-1, n_rows, n).float()  # [B, n_rows, n]
    count = A.shape[0]
    width = min(block, n)
    if count == 0:
        return TopSingular(A.new_zeros(batch), A.new_zeros(*batch, width, n))
    if column_sums is None:
        column_sums = A.sum(dim=-2)  # [B, n]
    # Drawn on the CPU, then moved: the same start vectors (and answers) on every device.
    start = torch.randn(count, width, n, generator=torch.Generator().manual_seed(0)).to(A.device)  # [B, b, n]
    start[:, 0] = 1.0
    if width > 1:
        start[:, 1] = column_sums.reshape(count, n)
    if warm_start is not None and width > 2:
        warm = warm_start.reshape(count, -1, n)[:, -(width - 2):]  # [B, k, n], best kept
        start[:, 2 : 2 + warm.shape[1]] = warm

    # Vectors are rows throughout: products read A row-major as `rows @ A.mT` and `rows @ A`,
    # which MKL runs 2-4x faster than `A @ columns` for a thin block.
    basis = _orthonormal_rows(start)  # [B, m, n], orthonormal rows spanning the subspace
    images = A.new_empty(count, 0, n_rows)  # [B, m, n_rows]: rows (A q)ᵀ
    pulled = A.new_empty(count, 0, n)  # [B, m, n]: rows (AᵀA q)ᵀ
    new = basis
    max_basis = min(n, MAX_BASIS_BLOCKS * width)
    theta = torch.zeros(count, dtype=torch.float64, device=A.device)
    done = torch.zeros(count, dtype=torch.bool, device=A.device)
    for _ in range(max_iterations):
        new_images = new @ A.mT  # [B, b, n_rows]
        images = torch.cat([images, new_images], dim=1)
        pulled = torch.cat([pulled, new_images @ A], dim=1)  # [B, m, n]
        gram = (images @ images.mT).double()  # [B, m, m] = Qᵀ AᵀA Q
        ritz_values, ritz_vectors = torch.linalg.eigh(gram)  # ascending
        keep = ritz_vectors[:, :, -width:].mT.float()  # [B, b, m]: top Ritz vectors, best last
        ritz_basis, ritz_pulled = keep @ basis, keep @ pulled  # [B, b, n]
        residuals = ritz_pulled - ritz_values[:, -width:, None].float() * ritz_basis  # [B, b, n]
        top = ritz_values[:, -1]
        converged = residuals[:, -1].norm(dim=-1).double() <= rtol * top
        # A finished matrix keeps the value it finished with; more iterations only cost time.
        theta = torch.where(done, theta, top)
        done |= converged
        if bool(done.all()):
            break
        if basis.shape[1] + width > max_basis:
            # Restart from the top Ritz vectors: their images are combinations of the stored
            # ones, so no product with A is spent on the restart.
            basis, images, pulled = ritz_basis, keep @ images, ritz_pulled
        # Never more directions than the space has left: extra ones could not be orthonormal.
        room = min(width, max_basis - basis.shape[1])
        if room == 0:
            break
        new = _extend(basis, residuals[:, width - room :])
        basis = torch.cat([basis, new], dim=1)
    sigma = theta.clamp_min(0).sqrt().float()
    if not bool(done.all()):
        # Nearly equal top singular values can stall the iteration; LAPACK settles those.
        sigma[~done] = spectral_norm_exact(A[~done])
    return TopSingular(sigma.reshape(batch), ritz_basis.reshape(*batch, width, n))


def _extend(basis: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """Orthonormal rows spanning `directions` outside the span of `basis` (orthonormal rows).

    Projected out twice: after one pass, directions that were almost inside the span come back
    as rounding noise that is not orthogonal to it ("twice is enough", Kahan–Parlett).
    """
    for _ in range(2):
        directions = directions - (directions @ basis.mT) @ basis  # [B, b, n]
        directions = _orthonormal_rows(directions)
    return directions


def _orthonormal_rows(rows: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the span of the rows of each [b, m] block."""
    return torch.linalg.qr(rows.mT).Q.mT  # [B, b, m]
