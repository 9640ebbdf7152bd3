"""The ``reference`` backend: obvious and slow, the oracle for every test.

For each type ``alpha`` it builds the dense effective matrix ``W_eff(alpha)`` (the
weight with every block outside the support zeroed) and multiplies the rows of
that type by it; autograd differentiates it.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["effective_weight", "element_mask", "reference_linear"]


def element_mask(block_mask: np.ndarray, in_widths: list[int], out_widths: list[int],
                 device: torch.device | None = None) -> torch.Tensor:
    """``(N, K)`` bool mask from a ``(q, q)`` block mask over ``(beta, delta)``."""
    bm = torch.as_tensor(np.ascontiguousarray(block_mask.T), device=device)  # (delta, beta)
    rows = torch.as_tensor(out_widths, device=device)
    cols = torch.as_tensor(in_widths, device=device)
    return bm.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)


def effective_weight(weight: torch.Tensor, support_mask: np.ndarray, in_widths: list[int],
                     out_widths: list[int], alpha: int) -> torch.Tensor:
    """``W_eff(alpha)``: ``(N, K)`` weight of type ``alpha``, zeros off the support."""
    mask = element_mask(support_mask[alpha], in_widths, out_widths, weight.device)
    return weight * mask.to(weight.dtype)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, types: torch.Tensor,
                     support_mask: np.ndarray, in_widths: list[int],
                     out_widths: list[int]) -> torch.Tensor:
    """``y[m] = x[m] @ W_eff(types[m])^T`` for ``x (M, K)``, ``types (M,)`` -> ``(M, N)``,
    computed as the support's sum ``y_delta = sum_{beta: S[alpha, beta, delta]} x_beta
    W_{beta, delta}``: blocks off the support are never read, so a NaN or Inf in an input
    group (or weight block) a type does not use stays out of that type's outputs — the
    semantics every fast path follows (a multiply by a zero block would turn it into NaN)."""
    q = support_mask.shape[0]
    io = np.concatenate([[0], np.cumsum(in_widths)]).tolist()
    oo = np.concatenate([[0], np.cumsum(out_widths)]).tolist()
    y = x.new_zeros(x.shape[0], weight.shape[0])
    for alpha in range(q):
        rows = (types == alpha).nonzero().flatten()
        if rows.numel() == 0:
            continue
        xr = x.index_select(0, rows)  # (M_alpha, K)
        yr = x.new_zeros(rows.numel(), weight.shape[0])  # (M_alpha, N)
        for delta in range(q):
            for beta in range(q):
                if support_mask[alpha, beta, delta]:
                    yr[:, oo[delta]:oo[delta + 1]] += (
                        xr[:, io[beta]:io[beta + 1]]
                        @ weight[oo[delta]:oo[delta + 1], io[beta]:io[beta + 1]].t())
        y = y.index_copy(0, rows, yr)
    return y
