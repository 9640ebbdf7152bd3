"""Linear algebra used by the tests, in float64: PSD square roots with an eigenvalue
floor, subspaces, energies, random nulls."""

from __future__ import annotations

import torch

__all__ = ["captured_energy", "effective_rank", "energy_weighted_basis", "psd_inv_sqrt",
           "psd_roots", "psd_sqrt", "random_like_spectrum", "random_orthonormal", "singular_values",
           "subspace_overlap", "symmetric_eigh_", "thin_svd", "top_eigenvectors_", "top_subspace"]

EXPLICIT_EIGH_MAX = 1024
"""Above this dimension the shared basis is found by subspace iteration, not ``eigh``."""


_ROW_BLOCK = 1024
"""Rows of a ``V diag(f) Vᵀ`` product formed at a time (its temporary: this many rows)."""


def _check_lapack_input(A: torch.Tensor, who: str) -> None:
    """``A`` can be handed to LAPACK in place: square, contiguous float64 on the CPU,
    outside autograd (else a ValueError naming ``who`` and what it got)."""
    if A.dim() != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"{who} needs a square matrix, got {tuple(A.shape)}")
    if (A.dtype != torch.float64 or not A.is_contiguous() or A.device.type != "cpu"
            or A.requires_grad):
        raise ValueError(f"{who} needs a contiguous float64 CPU matrix without autograd, "
                         f"got {A.dtype} on {A.device}")


def symmetric_eigh_(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(eigenvalues ascending, eigenvectors as columns)`` of symmetric float64 ``A``, as
    ``torch.linalg.eigh`` gives them, but **consuming** ``A``: LAPACK's divide-and-conquer
    driver ``syevd`` writes the eigenvectors over ``A``'s storage (the returned matrix is
    that storage, Fortran-ordered), so the peak is ``A`` plus about 0.3·dim² of
    workspace, where ``torch.linalg.eigh`` adds a copy and a ``2·dim²`` workspace to
    ``A`` (3.1·dim² measured, ``benchmarks/eigh_memory.py``: 2.9 GB more for an
    11,008-wide moment). Do not use ``A`` afterwards."""
    _check_lapack_input(A, "symmetric_eigh_")
    import scipy.linalg
    from threadpoolctl import threadpool_limits

    if not all(bool(torch.isfinite(A[a:a + _ROW_BLOCK]).all())  # by rows: no dim² mask
               for a in range(0, A.shape[0], _ROW_BLOCK)):
        raise torch.linalg.LinAlgError("symmetric_eigh_: the matrix has non-finite entries "
                                       "(no eigen-decomposition exists)")
    # A.T: the same symmetric matrix, Fortran-ordered, so LAPACK works in place (no copy);
    # SciPy's BLAS gets torch's thread count (an experiment's --threads holds for it too)
    with threadpool_limits(limits=torch.get_num_threads(), user_api="blas"):
        e, V = scipy.linalg.eigh(A.numpy().T, overwrite_a=True, driver="evd",
                                 check_finite=False)
    return torch.from_numpy(e), torch.from_numpy(V)


def _eigh_floored(C: torch.Tensor, rel_floor: float, consume: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of symmetric ``C`` with eigenvalues floored at
    ``rel_floor * max eigenvalue`` (damping against rank deficiency); ``consume``: a
    float64 contiguous ``C`` is symmetrised and decomposed in its own storage."""
    C = C.double()
    if consume and C.is_contiguous():
        sym = _symmetrize_(C)
    else:
        sym = (C + C.T).mul_(0.5)  # the one copy, consumed by the decomposition
    evals, evecs = symmetric_eigh_(sym)
    floor = rel_floor * float(evals.max().clamp_min(0))
    return evals.clamp_min(max(floor, 1e-300)), evecs


def _symmetrize_(C: torch.Tensor) -> torch.Tensor:
    """``C ← (C + Cᵀ)/2`` in place, a block pair at a time (bitwise what the out-of-place
    ``(C + C.T).mul_(0.5)`` gives; temporaries of one block)."""
    n, B = C.shape[0], _ROW_BLOCK
    for a in range(0, n, B):
        for b in range(a, n, B):
            upper, lower = C[a:a + B, b:b + B], C[b:b + B, a:a + B]
            mean = (upper + lower.T).mul_(0.5)
            upper.copy_(mean)
            lower.copy_(mean.T)
    return C


def _scaled_outer(V: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """``V diag(f) Vᵀ``, formed a block of rows at a time (no full-size temporary)."""
    out = torch.empty(V.shape[0], V.shape[0], dtype=V.dtype)
    for a in range(0, V.shape[0], _ROW_BLOCK):
        torch.mm(V[a:a + _ROW_BLOCK] * f, V.T, out=out[a:a + _ROW_BLOCK])
    return out


def psd_sqrt(C: torch.Tensor, rel_floor: float = 1e-8) -> torch.Tensor:
    """``C^{1/2}`` of a PSD matrix (float64)."""
    e, V = _eigh_floored(C, rel_floor)
    return _scaled_outer(V, e.sqrt())


def psd_roots(C: torch.Tensor, rel_floor: float = 1e-8, consume: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C^{1/2}, C^{-1/2})`` from one eigen-decomposition (float64, floored); the peak
    is ``C`` plus three of its size (the eigenvectors and the two roots). ``consume``
    (the caller never reads ``C`` again): a contiguous float64 ``C`` becomes the
    eigenvectors' storage, and the peak drops to three of its size. The roots are
    bitwise the same either way."""
    e, V = _eigh_floored(C, rel_floor, consume)
    return _scaled_outer(V, e.sqrt()), _scaled_outer(V, e.rsqrt())


def psd_inv_sqrt(C: torch.Tensor, rel_floor: float = 1e-8) -> torch.Tensor:
    """``C^{-1/2}`` with eigenvalues floored (a damped pseudo-inverse root, float64)."""
    e, V = _eigh_floored(C, rel_floor)
    return _scaled_outer(V, e.rsqrt())


def thin_svd(W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD ``(U, S, Vh)`` of ``W`` (float64) through the eigen-decomposition of its
    smaller Gram matrix — several times faster than LAPACK's SVD for tall or wide
    matrices; directions with ``S`` below ~1e-8 of the largest lose relative accuracy,
    which no energy-based quantity here can see."""
    W = W.double()
    wide = W.shape[0] < W.shape[1]
    A = W if wide else W.T  # (small, large)
    evals, evecs = symmetric_eigh_(A @ A.T)
    evals, evecs = evals.flip(0).clamp_min(0), evecs.flip(1)
    S = evals.sqrt()
    inv = torch.where(S > S[0] * 1e-12, 1.0 / S.clamp_min(1e-300), torch.zeros_like(S))
    other = (A.T @ evecs) * inv  # (large, small): the other side's singular vectors
    if wide:
        return evecs, S, other.T
    return other, S, evecs.T


def singular_values(W: torch.Tensor) -> torch.Tensor:
    """Singular values of ``W`` (float64, descending) from its smaller Gram matrix."""
    W = W.double()
    A = W if W.shape[0] < W.shape[1] else W.T
    return torch.linalg.eigvalsh(A @ A.T).flip(0).clamp_min(0).sqrt()


def top_subspace(W: torch.Tensor, k: int, side: str) -> torch.Tensor:
    """Orthonormal basis ``(dim, k)`` of the top-``k`` singular subspace of ``W``
    ``(out, in)``: ``side="input"`` → right singular vectors, ``"output"`` → left."""
    U, _, Vh = thin_svd(W)
    if side == "output":
        return U[:, :k]
    if side == "input":
        return Vh[:k].T
    raise ValueError(f"side must be 'input' or 'output', got {side!r}")


def captured_energy(W: torch.Tensor, basis: torch.Tensor, side: str) -> float:
    """Fraction of ``||W||_F^2`` kept by projecting ``W`` onto ``basis`` on ``side``."""
    W = W.double()
    proj = W @ basis if side == "input" else basis.T @ W
    return float(proj.pow(2).sum() / W.pow(2).sum())


def top_eigenvectors_(G: torch.Tensor, k: int) -> torch.Tensor:
    """The top-``k`` eigenvectors ``(dim, k)`` of symmetric float64 ``G``, by decreasing
    eigenvalue. **Consumes** ``G`` (LAPACK's MRRR driver ``syevr`` overwrites it in place,
    then its storage is released: ``G`` is empty afterwards): the peak is ``G`` plus the
    ``(dim, k)`` result, where ``torch.linalg.eigh`` holds ``G``, a
    copy and a ``2·dim²`` workspace — 1.5 GB instead of 3 GB for a 9,728-wide Gram
    matrix (Qwen2.5-Coder's stacked ``[gate; up]``)."""
    _check_lapack_input(G, "top_eigenvectors_")
    dim = G.shape[0]
    if not 1 <= k <= dim:
        raise ValueError(f"k={k} must be in [1, {dim}]")
    import scipy.linalg
    from threadpoolctl import threadpool_limits

    # G.T: the same symmetric matrix, Fortran-ordered, so LAPACK works in place (no copy);
    # SciPy's BLAS gets torch's thread count (an experiment's --threads holds for it too)
    with threadpool_limits(limits=torch.get_num_threads(), user_api="blas"):
        # (check_finite stays on: LAPACK finds no eigenpairs of a non-finite matrix)
        _, Z = scipy.linalg.eigh(G.numpy().T, overwrite_a=True, driver="evr",
                                 subset_by_index=[dim - k, dim - 1])
    G.set_()  # consumed: its storage goes before the reordered copy of Z is made
    if Z.shape[1] != k:
        raise torch.linalg.LinAlgError(f"syevr found {Z.shape[1]} of the top {k} "
                                       "eigenvectors")
    return torch.from_numpy(Z[:, ::-1].copy())


def energy_weighted_basis(mats: list[torch.Tensor], k: int, side: str,
                          iters: int = 5) -> torch.Tensor:
    """Shared basis: top-``k`` eigenvectors of ``G = sum_l W_l^T W_l`` (input side) or
    ``sum_l W_l W_l^T`` (output side) — each layer weighted by its energy.

    Explicit ``eigh`` up to :data:`EXPLICIT_EIGH_MAX` dimensions (or when the Krylov
    span would be as wide as ``G``, e.g. ``k`` = a quarter of a 3072 side) — of the
    smaller Gram matrix ``A Aᵀ`` when the layers stack fewer rows than ``dim``; else a randomised
    block Krylov method (``iters`` powers of ``G`` applied implicitly, Rayleigh–Ritz on
    the whole Krylov span in float64), which avoids forming and diagonalising a large
    ``G`` and keeps ≥ 99.9% of the optimal captured energy in the tests."""
    dim = mats[0].shape[1] if side == "input" else mats[0].shape[0]
    width = (iters + 1) * (k + max(8, k // 4))  # the Krylov span's width
    if dim <= EXPLICIT_EIGH_MAX or width >= dim:  # (a span as wide as G: eigh is cheaper)
        rows = sum(W.shape[0] if side == "input" else W.shape[1] for W in mats)
        if k < rows < dim:  # fewer stacked rows than dim: eigh of the small Gram A Aᵀ
            A = torch.cat([W.double() if side == "input" else W.double().T for W in mats])
            _, U = symmetric_eigh_(A @ A.T)
            V = A.T @ U[:, -k:].flip(1)  # G's eigenvectors, norms sqrt(eigenvalue)
            norms = V.norm(dim=0)
            if float(norms.min()) > 1e-3 * float(norms.max()):  # orthonormal to ~1e-10
                return V / norms
        G = torch.zeros(dim, dim, dtype=torch.float64)  # summed layer by layer: no stack
        for W in mats:
            Wd = W.double()
            G.addmm_(Wd.T, Wd) if side == "input" else G.addmm_(Wd, Wd.T)  # no temporary
        return top_eigenvectors_(G, k)
    # block Krylov (float32 iterations, float64 Rayleigh-Ritz): the span of
    # [X, G X, ..., G^q X] holds the top-k subspace far better than G^q X alone
    A32 = torch.cat([W.float() if side == "output" else W.float().T for W in mats], 1)
    gen = torch.Generator().manual_seed(0)
    X = torch.linalg.qr(torch.randn(dim, k + max(8, k // 4), generator=gen))[0]
    blocks = [X]
    for _ in range(iters):
        X = torch.linalg.qr(A32 @ (A32.T @ X))[0]
        blocks.append(X)
    Q = torch.linalg.qr(torch.cat(blocks, 1).double())[0]  # (dim, (q+1)(k+p))
    B = A32.T @ Q.float()  # (sum of widths, (q+1)(k+p))
    _, V = torch.linalg.eigh((B.T @ B).double())
    return torch.linalg.qr(Q @ V[:, -k:].flip(1))[0]


def random_orthonormal(dim: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A Haar-random ``(dim, k)`` orthonormal basis."""
    Q, R = torch.linalg.qr(torch.randn(dim, k, generator=gen, dtype=torch.float64))
    return Q * torch.sign(torch.diagonal(R))


def random_like_spectrum(W: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random matrix with exactly the singular values of ``W`` (Haar-random singular
    vectors)."""
    out, inn = W.shape
    s = singular_values(W)
    r = s.numel()
    return (random_orthonormal(out, r, gen) * s) @ random_orthonormal(inn, r, gen).T


def subspace_overlap(A: torch.Tensor, B: torch.Tensor) -> float:
    """Mean squared cosine of the principal angles between two ``(dim, k)`` orthonormal
    bases: ``||A^T B||_F^2 / k`` (chance level for random subspaces: ``k / dim``)."""
    return float((A.T @ B).pow(2).sum() / A.shape[1])


def effective_rank(W: torch.Tensor, energy: float = 0.9) -> int:
    """Fewest singular directions holding ``energy`` of ``||W||_F^2``."""
    s2 = singular_values(W).pow(2)
    cum = torch.cumsum(s2, 0) / s2.sum()
    return int(torch.searchsorted(cum, torch.tensor(energy, dtype=cum.dtype)).item()) + 1
