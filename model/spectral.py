"""σ_max of batches of matrices: exactly by LAPACK, or fast by a block Krylov method on AᵀA.

Both return float32 values computed from float32 matrices. `fast` certifies each value to
FAST_RTOL / 2 relative of the *largest* singular value (see `top_singular_fast`): a matrix it
cannot certify so, one with negative entries, or one smaller than LAPACK_BELOW, is handed to
LAPACK. The first three are counted (`TopSingular.fallbacks`): the values are LAPACK's, so that
count is the only place a fast method that stopped certifying shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("exact", "fast")

# Relative tolerance on σ_max² (the residual that stops the iteration, then the gap between the
# Rayleigh quotient and the upper bound), so σ_max is certified to 5e-5 (the service promises 1e-4).
FAST_RTOL = 1e-4
# Block width. The iteration is bound by reading A from memory, and a pass costs about the
# same for 1 or 16 vectors on CPU, so a wide block buys convergence at almost no cost.
BLOCK = 16
MAX_ITERATIONS = 60
# Restart the subspace when it holds this many blocks: keeps the small eigenproblems small.
MAX_BASIS_BLOCKS = 4
# Seeded random start vectors kept whatever warm start is given: a warm start from other matrices
# can span directions all orthogonal to this matrix's top singular vector.
RANDOM_START = 2
# Collatz–Wielandt certificate (see `_perron_upper_bound`): power steps, and floors (relative to
# the largest entry) added to the Ritz vector so that no entry is 0. Each floor gives a valid
# bound and the smallest is kept; several cover smooth heads (small floors) and sharp ones.
PERRON_STEPS = 2
PERRON_FLOORS = (1e-5, 1e-4)
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
    # Matrices the iteration ran on (0 when LAPACK answered for all of them by design: `exact`,
    # or smaller than LAPACK_BELOW), and those of them it could not certify and handed to
    # LAPACK. The values are right either way; a rising count is the fast method failing quietly.
    iterated: int = 0
    fallbacks: int = 0


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
    # One batched call: the same LAPACK routine per matrix on CPU. On CUDA, torch's default
    # driver is cuSOLVER's gesvdj, a Jacobi method that stops at a tolerance: in float32 on an
    # H200 it was off from float64 by 1e-5 to 3e-4 on attention matrices (3.1e-3 on a sharp
    # 130 x 130 one). gesvd runs LAPACK's algorithm (bidiagonalisation, QR iteration): within
    # 2e-7 there, and faster at n = 1024 (0.69 s against 1.34 s for 12 matrices).
    driver = "gesvd" if flat.is_cuda else None
    return torch.linalg.svdvals(flat, driver=driver).amax(dim=-1).reshape(batch)


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
    towards σ_max², and never passes it. A matrix stops iterating when θ's Ritz vector y has
    ‖AᵀA y − θ y‖ ≤ rtol·θ. That only puts θ near *some* eigenvalue of AᵀA: a top singular
    vector that the subspace missed (start vectors nearly orthogonal to it, a restart that
    dropped it) leaves θ at a smaller one, with as small a residual.

    So the value is certified against the largest by an upper bound: for A ≥ 0 (attention
    probabilities), AᵀA ≥ 0 and, for every positive vector d, σ_max² ≤ max_i (AᵀA d)_i / d_i
    (Collatz–Wielandt). With d near the Perron vector (y after a few power steps) the bound
    meets θ; a matrix is certified when it is within rtol of θ, so σ_max ∈ [√θ, √θ·(1 + rtol/2)].
    Matrices with negative entries have no such bound and, like those whose bound stays above,
    or that do not converge within the iteration budget, go to LAPACK.
    The subspace restarts from the top Ritz vectors when it holds MAX_BASIS_BLOCKS blocks.

    Start block: the all-ones vector and the column sums Aᵀ1 (for an attention matrix A·1 = 1,
    so Aᵀ1 = AᵀA·1 is one power step ahead, free when the caller has it already), then the rows
    of `warm_start` [..., k, n] (e.g. the `vectors` of similar matrices: the same head one layer
    down), then at least RANDOM_START seeded random vectors, so the answer does not depend on
    global RNG state. Start vectors only change how soon a matrix is certified, never the value.
    """
    *batch, n_rows, n = matrices.shape
    A = matrices.reshape(-1, n_rows, n).float()  # [B, n_rows, n]
    count = A.shape[0]
    width = min(block, n)
    if count == 0:
        return TopSingular(A.new_zeros(batch), A.new_zeros(*batch, width, n))
    nonnegative = A.amin(dim=(-2, -1)) >= 0  # [B]
    if column_sums is None:
        column_sums = A.sum(dim=-2)  # [B, n]
    # Drawn on the CPU, then moved: the same start vectors (and answers) on every device.
    start = torch.randn(count, width, n, generator=torch.Generator().manual_seed(0)).to(A.device)  # [B, b, n]
    start[:, 0] = 1.0
    if width > 1:
        start[:, 1] = column_sums.reshape(count, n)
    if warm_start is not None and width > 2 + RANDOM_START:
        warm = warm_start.reshape(count, -1, n)[:, -(width - 2 - RANDOM_START) :]  # [B, k, n], best kept
        start[:, 2 : 2 + warm.shape[1]] = warm

    # Vectors are rows throughout: products read A row-major as `rows @ A.mT` and `rows @ A`,
    # which MKL runs 2-4x faster than `A @ columns` for a thin block.
    basis = _orthonormal_rows(start)  # [B, m, n], orthonormal rows spanning the subspace
    images = A.new_empty(count, 0, n_rows)  # [B, m, n_rows]: rows (A q)ᵀ
    pulled = A.new_empty(count, 0, n)  # [B, m, n]: rows (AᵀA q)ᵀ
    new = basis
    max_basis = min(n, MAX_BASIS_BLOCKS * width)
    theta = torch.zeros(count, dtype=torch.float64, device=A.device)
    top_vector = A.new_zeros(count, n)  # the Ritz vector θ was taken with
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
        top_vector = torch.where(done[:, None], top_vector, ritz_basis[:, -1])
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
    certified = done & nonnegative
    if bool(certified.all()):  # the usual case: no copy of A
        certified = _perron_upper_bound(A, top_vector) <= theta * (1 + rtol)
    elif bool(certified.any()):
        bound = _perron_upper_bound(A[certified], top_vector[certified])
        certified[certified.clone()] = bound <= theta[certified] * (1 + rtol)
    fallbacks = int((~certified).sum())
    if fallbacks:
        sigma[~certified] = spectral_norm_exact(A[~certified])
    return TopSingular(sigma.reshape(batch), ritz_basis.reshape(*batch, width, n), count, fallbacks)


def _perron_upper_bound(A: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """An upper bound on σ_max² of each A ≥ 0 [B, n_rows, n], from estimates of its top right
    singular vector [B, n]: min over floors of max_i (AᵀA d)_i / d_i (Collatz–Wielandt), d the
    floored |vector| after PERRON_STEPS power steps.

    Every d > 0 gives a valid bound; the floors keep d > 0 and the power steps make its small
    entries consistent with the large ones, which a float32 Ritz vector's are not. The products
    add nonnegative terms only, so float32 rounding moves each ratio by a few ulps times √n
    (no cancellation), far inside the 1e-4 the bound is compared with.
    """
    d = vectors.abs()[:, None, :]  # [B, 1, n]
    floors = torch.tensor(PERRON_FLOORS, dtype=A.dtype, device=A.device)[:, None]  # [F, 1]
    d = d / d.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(A.dtype).tiny) + floors  # [B, F, n]
    for _ in range(PERRON_STEPS):
        d = (d @ A.mT) @ A
        d = d / d.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(A.dtype).tiny)
    image = ((d @ A.mT) @ A).double()  # [B, F, n]
    d = d.double()
    # d_i = 0 after a power step only where row i of AᵀA is 0: index i then bounds nothing.
    ratio = torch.where(d > 0, image / d, torch.where(image > 0, torch.inf, 0.0))
    return ratio.amax(dim=-1).amin(dim=-1)  # [B]


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
