"""Factorised linear modules that replace a model's matrices (no dense matrix is ever
rebuilt at run time).

* :class:`SharedBasisLinear` — ``y = U (A_l (P x)) [+ B_l (C_l x)] + b`` with the
  shared input map ``P = V^T S^+`` ``(k, in)`` and output basis ``U`` ``(out, k)``
  held by a :class:`SharedBasis` module (stored once per matrix type, frozen), the
  per-layer rectangular core ``A_l`` ``(k_out, k_in)`` and an optional per-layer
  residual ``B_l C_l`` of rank ``r``.
* :class:`LowRankLinear` — ``y = B (C x) + b``: per-layer whitened SVD factors
  (``B = U_r Σ_r``, ``C = V_r^T S_l^+``), trained as free factors.
* :class:`OneSidedLinear` — ``y = D_l (P x) + b``: one input basis shared by a group of
  layers with full per-layer coefficients ``D_l`` ``(out, k)`` (Basis Sharing).

Every product is a :func:`~structlm.nn.fast_linear` (``F.linear``, or at cached decode on
the CPU the project's few-row kernel, the same path the original model's layers take
under :func:`~structlm.hf.decode.use_decode_kernels_`; the bias fused into the
last one). The two-sided
module picks, per call, the cheaper of two association orders (see
:func:`shared_basis_macs`): at a budget where ``k_out`` is close to ``out`` the chain
``U (A (P x))`` costs several times a dense matrix per token, while merging ``U A``
first costs ``out·k_out·k_in`` once per call and then ``in·k_in + k_in·out`` per token.
"""

from __future__ import annotations

import torch
from torch import nn

from structlm.nn.decode_linear import fast_linear

__all__ = ["LowRankLinear", "OneSidedLinear", "SharedBasis", "SharedBasisLinear",
           "shared_basis_macs"]


def shared_basis_macs(tokens: int, out: int, inn: int, k_out: int, k_in: int
                      ) -> dict[str, int]:
    """Multiply–accumulates of one ``U A P x`` call on ``tokens`` rows, per order:
    ``chain`` = ``U (A (P x))``; ``merged`` = ``(U A) (P x)`` with ``U A`` formed in
    the call."""
    return {"chain": tokens * (inn * k_in + k_in * k_out + k_out * out),
            "merged": out * k_out * k_in + tokens * (inn * k_in + k_in * out)}


class SharedBasis(nn.Module):
    """The shared part of one matrix type: input map ``P`` ``(k, in)`` (``None`` for
    none) and output basis ``U`` ``(out, k)`` (``None`` for none), frozen."""

    def __init__(self, P: torch.Tensor | None, U: torch.Tensor | None) -> None:
        super().__init__()
        self.P = None if P is None else nn.Parameter(P.float().contiguous(), requires_grad=False)
        self.U = None if U is None else nn.Parameter(U.float().contiguous(), requires_grad=False)


class SharedBasisLinear(nn.Module):
    """``U A P x (+ B C x) + b`` for one layer; ``basis`` is shared between layers."""

    def __init__(self, basis: SharedBasis, core: torch.Tensor, bias: torch.Tensor | None,
                 residual: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        if basis.P is None or basis.U is None:
            raise ValueError("SharedBasisLinear needs both a shared input map P and basis U")
        self.basis = basis
        self.core = nn.Parameter(core.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.float().clone(),
                                                           requires_grad=False)
        self.res_b = self.res_c = None
        if residual is not None:
            self.res_b = nn.Parameter(residual[0].float().contiguous())
            self.res_c = nn.Parameter(residual[1].float().contiguous())

    @property
    def in_features(self) -> int:
        return self.basis.P.shape[1]

    @property
    def out_features(self) -> int:
        return self.basis.U.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = fast_linear(x, self.basis.P)  # (..., k_in)
        k_out, k_in = self.core.shape
        macs = shared_basis_macs(x.numel() // max(x.shape[-1], 1), self.out_features,
                                 self.in_features, k_out, k_in)
        if macs["merged"] < macs["chain"]:
            y = fast_linear(z, self.basis.U @ self.core, self.bias)  # (..., out)
        else:
            y = fast_linear(fast_linear(z, self.core), self.basis.U, self.bias)  # (..., out)
        if self.res_b is not None:
            y = y + fast_linear(fast_linear(x, self.res_c), self.res_b)  # (..., out)
        return y

    def dense_weight(self) -> torch.Tensor:
        """The equivalent ``(out, in)`` matrix (for analysis and tests only)."""
        W = self.basis.U @ self.core @ self.basis.P
        return W if self.res_b is None else W + self.res_b @ self.res_c


class LowRankLinear(nn.Module):
    """``B (C x) + b`` with per-layer factors ``B`` ``(out, r)``, ``C`` ``(r, in)``."""

    def __init__(self, B: torch.Tensor, C: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.B = nn.Parameter(B.float().contiguous())
        self.C = nn.Parameter(C.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.float().clone(),
                                                           requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fast_linear(fast_linear(x, self.C), self.B, self.bias)  # (..., r) then (..., out)

    def dense_weight(self) -> torch.Tensor:
        return self.B @ self.C


class OneSidedLinear(nn.Module):
    """``D (P x) + b`` with the shared input map ``P`` ``(k, in)`` and per-layer
    coefficients ``D`` ``(out, k)``."""

    def __init__(self, basis: SharedBasis, D: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if basis.P is None:
            raise ValueError("OneSidedLinear needs a shared input map P")
        self.basis = basis
        self.D = nn.Parameter(D.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.float().clone(),
                                                           requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fast_linear(fast_linear(x, self.basis.P), self.D, self.bias)  # (..., k), (..., out)

    def dense_weight(self) -> torch.Tensor:
        return self.D @ self.basis.P
