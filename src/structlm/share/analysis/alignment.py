"""Test 1 — whole-matrix alignment of each layer's matrix to a reference layer.

Moves, each followed by the best global scale ``s`` (so every residual is at most 1):

* ``raw``: no move and no scale, ``||R - W||^2 / ||R||^2`` — informational only: it is
  ≈ 2 for *any* two near-orthogonal matrices of equal norm (a Gaussian pair too), so a
  drop measured from it says nothing about structure;
* ``scale``: ``min_s ||R - s W||^2 / ||R||^2 = 1 - cos^2(R, W)``;
* ``perm``: row and column permutations (Hungarian algorithm,
  ``scipy.optimize.linear_sum_assignment``: rows by scaling- and column-order-invariant
  signatures, then columns by inner products; the identity is kept when better);
* ``perm_diag``: the permutations plus diagonal row and column scalings (alternating
  least squares) — the "cheap moves" of the Rubik's-cube hypothesis;
* ``rot1``: one-sided orthogonal Procrustes on the input side,
  ``min_{O orthogonal} ||R - s W O||`` (closed form: nuclear norm of ``W^T R``);
* ``rot2``: two-sided rotations ``min_{P, O} ||R - s P W O||``, which only sees the two
  singular spectra (von Neumann): ``1 - (σ_R · σ_W)^2 / (||R||^2 ||W||^2)``.

The cheap-move drop is measured from the ``scale`` baseline and split into its
permutation part (``scale → perm``) and its diagonal part (``perm → perm_diag``) by
:func:`drop_split`; the analysis reports it for the real matrices and, beside them, for
the nulls run through the same moves.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from structlm.hf.linalg import singular_values

__all__ = ["DROP_PARTS", "MOVES", "align", "drop_split", "row_signature"]

MOVES = ("raw", "scale", "perm", "perm_diag", "rot1", "rot2")

DROP_PARTS = ("total", "permutation", "diagonal")
"""Parts of the cheap-move drop from the ``scale`` baseline: ``scale − perm_diag`` =
``(scale − perm)`` + ``(perm − perm_diag)``."""


def _scaled_residual(R: torch.Tensor, W: torch.Tensor) -> float:
    """``min_s ||R - s W||^2 / ||R||^2``."""
    rw = float((R * W).sum())
    return 1.0 - rw * rw / (float(R.pow(2).sum()) * float(W.pow(2).sum()))


def _match(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Permutation ``p`` maximising ``sum_i <A_i, B_p(i)>`` over rows (Hungarian)."""
    return torch.as_tensor(linear_sum_assignment((A @ B.T).numpy(), maximize=True)[1])


def _stack(M: torch.Tensor, blocks: int) -> torch.Tensor:
    """Rows of ``blocks`` equal row blocks side by side: ``(blocks*n, m) -> (n, blocks*m)``."""
    n = M.shape[0] // blocks
    return M.reshape(blocks, n, M.shape[1]).permute(1, 0, 2).reshape(n, -1)


def _unstack(M: torch.Tensor, blocks: int) -> torch.Tensor:
    n, m = M.shape[0], M.shape[1] // blocks
    return M.reshape(n, blocks, m).permute(1, 0, 2).reshape(blocks * n, m)


def row_signature(M: torch.Tensor, row_blocks: int = 1) -> torch.Tensor:
    """Rows of ``M`` (row blocks side by side) as signatures invariant to column
    permutations and diagonal scalings: magnitudes balanced Sinkhorn-style so every row
    and column has unit norm, then each row sorted and normalised."""
    A = _stack(M, row_blocks).abs()
    for _ in range(30):  # Sinkhorn-style balancing: removes diagonal scalings
        A = A / A.norm(dim=1, keepdim=True).clamp_min(1e-300)
        A = A / A.norm(dim=0, keepdim=True).clamp_min(1e-300)
    srt = A.sort(dim=1).values  # then sorting removes the column order
    return srt / srt.norm(dim=1, keepdim=True).clamp_min(1e-300)


def _permute(R: torch.Tensor, W: torch.Tensor, rounds: int = 1,
             row_blocks: int = 1, ref_signature: torch.Tensor | None = None) -> torch.Tensor:
    """``W`` with rows and columns permuted to best match ``R``.

    The first row matching compares signatures invariant to column permutations and
    to diagonal scalings (magnitudes balanced Sinkhorn-style so every row and column
    has unit norm, then each row sorted); then columns and rows are matched by inner
    products, alternately, ``rounds`` times. With ``row_blocks = b`` the rows form b
    equal blocks permuted together (a gated MLP's stacked ``[gate; up]``: hidden unit i
    is row i of both blocks), which is also b³ times cheaper. ``ref_signature``:
    :func:`row_signature` of ``R`` when already computed (one per reference)."""
    Rs, Ws = _stack(R, row_blocks), _stack(W, row_blocks)
    if ref_signature is None:
        ref_signature = row_signature(R, row_blocks)
    Ws = Ws[_match(ref_signature, row_signature(W, row_blocks))]
    W = _unstack(Ws, row_blocks)
    for r in range(rounds):
        W = W[:, _match(R.T, W.T)]
        if r < rounds - 1:
            Ws = _stack(W, row_blocks)
            W = _unstack(Ws[_match(Rs, Ws)], row_blocks)
    return W


def _diag_scale(R: torch.Tensor, W: torch.Tensor, iters: int = 5) -> torch.Tensor:
    """``D_r W D_c`` with diagonal scalings fitted to ``R`` by alternating least squares."""
    dr = torch.ones(W.shape[0], dtype=W.dtype)
    dc = torch.ones(W.shape[1], dtype=W.dtype)
    for _ in range(iters):
        Wc = W * dc
        dr = (R * Wc).sum(1) / Wc.pow(2).sum(1).clamp_min(1e-300)
        Wr = W * dr[:, None]
        dc = (R * Wr).sum(0) / Wr.pow(2).sum(0).clamp_min(1e-300)
    return W * dr[:, None] * dc


def align(R: torch.Tensor, W: torch.Tensor, row_blocks: int = 1,
          ref_signature: torch.Tensor | None = None) -> dict[str, float]:
    """Residual relative energy of ``W`` aligned to reference ``R`` (both ``(out, in)``)
    under each move of :data:`MOVES` (``row_blocks``, ``ref_signature``: see
    :func:`_permute`)."""
    if R.shape != W.shape:
        raise ValueError(f"cannot align shapes {tuple(W.shape)} to {tuple(R.shape)}")
    if row_blocks < 1 or R.shape[0] % row_blocks:
        raise ValueError(f"row_blocks={row_blocks} must divide the {R.shape[0]} rows")
    R, W = R.double(), W.double()
    er, ew = float(R.pow(2).sum()), float(W.pow(2).sum())
    out = {"raw": float((R - W).pow(2).sum()) / er, "scale": _scaled_residual(R, W)}
    Wp = _permute(R, W, row_blocks=row_blocks, ref_signature=ref_signature)
    if _scaled_residual(R, Wp) > out["scale"]:  # the identity is a permutation too
        Wp = W
    out["perm"] = _scaled_residual(R, Wp)
    out["perm_diag"] = _scaled_residual(R, _diag_scale(R, Wp))
    if W.shape[0] >= W.shape[1]:  # nuclear norm of W^T R via the smaller Gram side
        nuc = float(torch.linalg.svdvals(W.T @ R).sum())
    else:
        Rw = torch.linalg.qr(W.T)[1]  # W^T = Qw Rw, R^T = Qr Rr: W^T R = Qw Rw Rr^T Qr^T
        Rr = torch.linalg.qr(R.T)[1]
        nuc = float(torch.linalg.svdvals(Rw @ Rr.T).sum())
    out["rot1"] = 1.0 - nuc * nuc / (er * ew)
    sr, sw = singular_values(R), singular_values(W)
    dot = float((sr * sw).sum())
    out["rot2"] = 1.0 - dot * dot / (er * ew)
    return {m: max(0.0, out[m]) if m != "raw" else out[m] for m in MOVES}


def drop_split(residuals: list[dict[str, float]]) -> dict[str, float]:
    """The cheap-move drop from the ``scale`` baseline over layers: medians of the
    per-layer ``total`` (``scale − perm_diag``), ``permutation`` (``scale − perm``) and
    ``diagonal`` (``perm − perm_diag``) drops, and ``permutation_share`` = summed
    permutation drop / summed total drop (NaN when the total is ~0)."""
    if not residuals:
        nan = float("nan")
        return {"total": nan, "permutation": nan, "diagonal": nan, "permutation_share": nan}
    perm = [r["scale"] - r["perm"] for r in residuals]
    diag = [r["perm"] - r["perm_diag"] for r in residuals]
    total = [p + d for p, d in zip(perm, diag, strict=True)]
    s_total = float(sum(total))
    return {"total": float(np.median(total)), "permutation": float(np.median(perm)),
            "diagonal": float(np.median(diag)),
            "permutation_share": float(sum(perm)) / s_total if s_total > 1e-12
            else float("nan")}
