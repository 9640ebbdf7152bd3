"""The closed-form refit of a compressed type's per-layer output factors with the input
factors fixed: Basis Sharing's optional update step and SVD-LLM's layer-wise update both
solve ``min_D E||W x − D P x||²`` under the compressed model's inputs, whose float64
solution from the second moment ``C = E[x xᵀ]`` is ``D = W C Pᵀ (P C Pᵀ)^{-1}``
(:func:`update_coefficients`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from structlm.hf.adapters import ConcatProjection
from structlm.hf.linalg import psd_inv_sqrt, psd_sqrt
from structlm.nn.factorized import LowRankLinear, OneSidedLinear

__all__ = ["update_coefficients"]


def _refit(Ws: list[torch.Tensor], C: torch.Tensor, P: torch.Tensor,
           floor: float) -> list[torch.Tensor]:
    """Closed-form coefficients ``D_l = W_l C Pᵀ (P C Pᵀ)^{-1}`` for a fixed basis ``P``
    ``(k, in)`` under the input second moment ``C`` (damped by a relative eigenvalue
    floor, float64)."""
    P = P.double()
    G = P @ C @ P.T  # (k, k)
    G_inv = psd_inv_sqrt(G, floor)
    G_inv = G_inv @ G_inv
    return [w.double() @ C @ P.T @ G_inv for w in Ws]


def update_coefficients(modules: list[nn.Module], originals: list[torch.Tensor],
                        new_Cs: Sequence[torch.Tensor], groups: list[list[int]], parts: int,
                        floor: float = 1e-6) -> dict[str, Any]:
    """Basis Sharing's update step for one matrix type (and, with one group of one layer,
    SVD-LLM's refit of one layer's module, :mod:`.svd_llm`): refit every layer's coefficients
    (:class:`~structlm.nn.factorized.OneSidedLinear` ``D``, or the output factor ``B`` of a private
    :class:`~structlm.nn.factorized.LowRankLinear`) to the original weights ``originals`` under the
    compressed model's inputs ``new_Cs`` (summed over the group, as the paper's code
    does). ``modules``: one per layer (a :class:`~structlm.hf.adapters.ConcatProjection`
    of ``parts`` such modules for a gated MLP-in). Returns the whitened error before and
    after, per layer."""
    def pieces(m: nn.Module) -> list[nn.Module]:
        return list(m.parts) if isinstance(m, ConcatProjection) else [m]

    before, after = [], []
    for g in groups:
        C = sum(new_Cs[i].double() for i in g) / len(g)
        root = psd_sqrt(C, floor)
        for p in range(parts):
            mods = [pieces(modules[i])[p] for i in g]
            op = originals[g[0]].shape[0] // parts
            Ws = [originals[i][p * op:(p + 1) * op].double() for i in g]
            if isinstance(mods[0], OneSidedLinear):
                fitted = _refit(Ws, C, mods[0].basis.P.detach(), floor)
                targets = [m.D for m in mods]
                rebuilt = [lambda m, d: d @ m.basis.P.detach().double()] * len(mods)
            elif isinstance(mods[0], LowRankLinear):
                fitted = [_refit([w], C, m.C.detach(), floor)[0] for w, m in zip(Ws, mods,
                                                                                 strict=True)]
                targets = [m.B for m in mods]
                rebuilt = [lambda m, d: d @ m.C.detach().double()] * len(mods)
            else:
                raise TypeError(f"the update step refits OneSidedLinear / LowRankLinear "
                                f"coefficients, not {type(mods[0]).__name__}")
            for w, m, d, t, make in zip(Ws, mods, fitted, targets, rebuilt, strict=True):
                before.append(float(((w - make(m, t.detach().double())) @ root).pow(2).sum()))
                with torch.no_grad():
                    t.copy_(d.to(t.dtype))
                after.append(float(((w - make(m, d)) @ root).pow(2).sum()))
    return {"error_before": before, "error_after": after}
