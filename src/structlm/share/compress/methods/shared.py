"""``shared`` (the seed's method, test 4) and ``hybrid`` (test 9): two-sided shared bases
across all layers, the hybrid with a per-layer residual.

* ``shared``: shared whitening ``S = C̄^{1/2}`` from the mean covariance ``C̄``, shared
  bases ``U`` (top-``k_out`` output directions of ``Σ_l (W_l S)(W_l S)^T``) and ``V``
  (top-``k_in`` input directions of ``Σ_l (W_l S)^T (W_l S)``), rectangular per-layer
  cores ``A_l = U^T W_l S V`` ``(k_out, k_in)``: ``W_l ≈ U A_l V^T S^+``. Given a budget,
  ``(k_out, k_in)`` is the pair that keeps the most whitened energy
  ``Σ_l ||U^T W_l S V||²`` among those that fit (an exact search over ``k_out``; the
  leading-block energies come from one 2-D prefix sum), each bounded only by its own side.
* ``hybrid``: ``shared`` plus a per-layer residual ``B_l C_l`` of rank ``r``, the top-r
  SVD of the whitened basis error ``W_l S − U A_l V^T``, mapped back by ``S^+``.

Both are one class in one file because the hybrid *is* the shared method with a residual:
the same bases, cores, rank search (the residual's storage is reserved from the budget
first), modules (:class:`~structlm.nn.factorized.SharedBasisLinear` takes the residual as
an option) and accounting (``+ L r (out + in)``); only :attr:`has_residual` differs.

Stored parameters ``k_out·out + k_in·in + L k_out k_in (+ L r (out + in))``; MACs per
token ``L (k_in·in + k_out·k_in + out·k_out (+ r (out + in)))`` — a shared basis costs
MACs in every layer, so a two-sided type can cost more per token than the dense matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from torch import nn

from structlm.config import Range, validated
from structlm.hf.linalg import energy_weighted_basis, thin_svd
from structlm.nn.factorized import SharedBasis, SharedBasisLinear
from structlm.share.compress.factorize import (
    RootCache,
    TypeFactors,
    TypeRanks,
    kept_energy,
    meta_tensor,
    part_rows,
)
from structlm.share.compress.methods.base import METHODS, CompressionMethod, TypePlan, register

__all__ = ["HYBRID_METHOD", "SHARED_METHOD", "HybridOptions", "SharedBasisMethod",
           "best_rectangular_ranks", "factorize_shared"]


@dataclass
@validated
class HybridOptions:
    """The options of ``hybrid``: ``CompressionConfig.hybrid``."""

    residual_rank: Annotated[int, Range(ge=0)] = 32
    """Rank r of the per-layer residual."""


def best_rectangular_ranks(whitened: list[torch.Tensor], budget: float, extra_per_layer: int = 0
                           ) -> tuple[TypeRanks, torch.Tensor, torch.Tensor, float]:
    """The ``(k_out, k_in)`` of the two-sided shared bases that keeps the most whitened
    energy ``Σ_l ||U_{k_out}^T M_l V_{k_in}||²`` (``M_l = W_l S``) among the pairs whose
    storage ``k_out·out + k_in·in + L k_out k_in (+ L·extra_per_layer)`` fits ``budget``.

    Returns the ranks, the full output and input bases (columns by decreasing energy) and
    the kept share of ``Σ_l ||M_l||²``."""
    out, inn = whitened[0].shape
    L = len(whitened)
    room = budget - L * extra_per_layer
    U = energy_weighted_basis(whitened, out, "output")  # (out, out)
    V = energy_weighted_basis(whitened, inn, "input")  # (in, in)
    E = torch.zeros(out, inn, dtype=torch.float64)
    for m in whitened:
        E += (U.T @ m @ V).pow(2)
    F = E.cumsum(0).cumsum(1)  # F[a-1, b-1]: energy of the leading a × b block
    k_out = torch.arange(1, out + 1, dtype=torch.float64)
    k_in = torch.floor((room - k_out * out) / (inn + L * k_out)).clamp(max=inn)
    ok = k_in >= 1
    if not bool(ok.any()):
        raise ValueError(f"a budget of {budget:,.0f} parameters cannot hold rank-1 shared "
                         f"bases of {L} × ({out}, {inn})")
    idx = torch.nonzero(ok).squeeze(1)
    energy = F[idx, k_in[idx].long() - 1]
    best = int(idx[int(torch.argmax(energy))])
    ranks = TypeRanks(best + 1, int(k_in[best]))
    return ranks, U, V, float(F[best, ranks.k_in - 1] / F[-1, -1])


def factorize_shared(method: str, weights: list[torch.Tensor], Cs: Sequence[torch.Tensor],
                     ranks: TypeRanks | None = None, budget: float | None = None,
                     floor: float = 1e-6, roots: RootCache | None = None) -> TypeFactors:
    """``shared`` / ``hybrid`` factors with the given ``ranks``, or the energy-optimal
    ``(k_out, k_in)`` under ``budget`` (the hybrid's residual rank comes from ``ranks.r``
    either way; pass ``TypeRanks(0, 0, r)`` with a budget)."""
    m = METHODS.get(method)
    if not isinstance(m, SharedBasisMethod):
        names = [n for n, x in METHODS.items() if isinstance(x, SharedBasisMethod)]
        raise ValueError(f"factorize_shared handles {' and '.join(names)}, not {method!r}")
    out, inn = weights[0].shape
    L = len(weights)
    r = ranks.r if (ranks is not None and m.has_residual) else 0
    if not 0 <= r <= min(out, inn):
        raise ValueError(f"residual rank r={r} must be in [0, {min(out, inn)}]")
    C = sum(c.double() for c in Cs) / L
    S, S_inv = (roots or RootCache(floor)).get(C)
    Wh = [w.double() @ S for w in weights]  # the float64 originals are never held at once
    info: dict[str, Any] = {}
    if budget is not None:
        found, U_all, V_all, share = best_rectangular_ranks(Wh, budget, r * (out + inn))
        ranks = TypeRanks(found.k_out, found.k_in, r)
        U, V = U_all[:, :ranks.k_out], V_all[:, :ranks.k_in]
        info["whitened_energy_share_of_best_block"] = share
    elif ranks is not None:
        if not (1 <= ranks.k_out <= out and 1 <= ranks.k_in <= inn):
            raise ValueError(f"shared ranks (k_out={ranks.k_out}, k_in={ranks.k_in}) must be "
                             f"in [1, {out}] × [1, {inn}]")
        U = energy_weighted_basis(Wh, ranks.k_out, "output")  # (out, k_out)
        V = energy_weighted_basis(Wh, ranks.k_in, "input")  # (in, k_in)
    else:
        raise ValueError("factorize_shared needs ranks or a budget")
    tf = TypeFactors(method, ranks, [list(range(L))], 1, [{"P": V.T @ S_inv, "U": U}],
                     info=info)
    res_cover = []
    for w, wh, c in zip(weights, Wh, Cs, strict=True):
        A = U.T @ wh @ V  # (k_out, k_in)
        entry = {"core": A}
        What = U @ A @ tf.bases[0]["P"]
        if m.has_residual and r > 0:
            E = wh - U @ A @ V.T  # whitened basis error
            Ue, Se, Vhe = thin_svd(E)
            entry["res_b"], entry["res_c"] = Ue[:, :r] * Se[:r], Vhe[:r] @ S_inv
            What = What + entry["res_b"] @ entry["res_c"]
            res_cover.append(float(Se[:r].pow(2).sum() / Se.pow(2).sum().clamp_min(1e-300)))
        tf.per_layer.append(entry)
        tf.energy.append(kept_energy(w, What, c))
    if res_cover:
        tf.info["residual_share_of_basis_error"] = res_cover
    return tf


class SharedBasisMethod(CompressionMethod):
    """Two-sided shared bases over one group of all layers (``residual``: the hybrid)."""

    two_sided = True
    shares_across_layers = True
    splits_row_blocks = False

    def __init__(self, name: str, residual: bool) -> None:
        self.name = name
        self.has_residual = residual

    def default_groups(self, num_layers: int) -> list[list[int]]:
        """One group of all layers."""
        return [list(range(num_layers))]

    def default_ranks(self, k: int, shape: tuple[int, int], group_sizes: list[int],
                      parts: int, r: int) -> TypeRanks:
        """``k`` on each side as far as that side's dimension allows."""
        out, inn = shape
        return TypeRanks(min(k, out), min(k, inn), r)

    def budget_ranks(self, shape: tuple[int, int], group_sizes: list[int], parts: int,
                     budget: float, r: int) -> TypeRanks | None:
        """``None``: the energy-optimal ``(k_out, k_in)`` is found from the data."""
        return None

    def factorize(self, plan: TypePlan, weights: list[torch.Tensor], Cs: Sequence[torch.Tensor],
                  floor: float, roots: RootCache) -> TypeFactors:
        """:func:`factorize_shared` with the plan's ranks, or under its budget."""
        if plan.ranks is not None:
            return factorize_shared(self.name, weights, Cs, plan.ranks, None, floor, roots)
        return factorize_shared(self.name, weights, Cs, TypeRanks(0, 0, plan.residual_rank),
                                plan.budget, floor, roots)

    def build_modules(self, factors: TypeFactors, biases: list[torch.Tensor | None]
                      ) -> list[nn.Module]:
        """:class:`SharedBasisLinear` per layer around one :class:`SharedBasis`."""
        basis = SharedBasis(factors.bases[0]["P"], factors.bases[0]["U"])
        return [SharedBasisLinear(basis, e["core"], b,
                                  (e["res_b"], e["res_c"]) if "res_b" in e else None)
                for e, b in zip(factors.per_layer, biases, strict=True)]

    def stored_parameters(self, out: int, inn: int, ranks: TypeRanks,
                          group_sizes: list[int], parts: int = 1) -> int:
        """``k_out·out + k_in·in + L k_out k_in`` (``+ L r (out + in)``)."""
        part_rows(out, parts)
        L = sum(group_sizes)
        base = ranks.k_out * out + ranks.k_in * inn + L * ranks.k_out * ranks.k_in
        return base + (L * ranks.r * (out + inn) if self.has_residual else 0)

    def token_macs(self, out: int, inn: int, ranks: TypeRanks, group_sizes: list[int],
                   parts: int = 1) -> int:
        """``L (k_in·in + k_out·k_in + out·k_out)`` (``+ L r (out + in)``)."""
        part_rows(out, parts)
        L = sum(group_sizes)
        per = inn * ranks.k_in + ranks.k_in * ranks.k_out + ranks.k_out * out
        return L * (per + (ranks.r * (out + inn) if self.has_residual else 0))

    def placeholder(self, shape: tuple[int, int], ranks: TypeRanks, groups: list[list[int]],
                    parts: int) -> TypeFactors:
        """Meta ``P``, ``U``, per-layer ``core`` (+ ``res_b``, ``res_c`` for ``r > 0``)."""
        out, inn = shape
        r = ranks.r
        tf = TypeFactors(self.name, ranks, groups, parts)
        tf.bases = [{"P": meta_tensor(ranks.k_in, inn), "U": meta_tensor(out, ranks.k_out)}]
        tf.per_layer = [{"core": meta_tensor(ranks.k_out, ranks.k_in)}
                        | ({"res_b": meta_tensor(out, r), "res_c": meta_tensor(r, inn)}
                           if r else {})
                        for g in groups for _ in g]
        return tf


SHARED_METHOD = register(SharedBasisMethod("shared", residual=False))
"""The seed's two-sided shared bases."""
HYBRID_METHOD = register(SharedBasisMethod("hybrid", residual=True))
"""``shared`` plus a per-layer residual of rank ``residual_rank``."""
