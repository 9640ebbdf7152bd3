"""Factors of one matrix type across layers, from weights and calibration.

Notation: ``W_l`` ``(out, in)``, ``C_l`` its input second moment, ``L`` layers; every
product here is float64.

* ``shared`` (the seed's method, test 4): shared whitening ``S = C̄^{1/2}`` from the
  mean covariance ``C̄``, shared bases ``U`` (top-``k_out`` output directions of
  ``Σ_l (W_l S)(W_l S)^T``) and ``V`` (top-``k_in`` input directions of
  ``Σ_l (W_l S)^T (W_l S)``), rectangular per-layer cores ``A_l = U^T W_l S V``
  ``(k_out, k_in)``: ``W_l ≈ U A_l V^T S^+``. Given a budget, ``(k_out, k_in)`` is the
  pair that keeps the most whitened energy ``Σ_l ||U^T W_l S V||²`` among those that fit
  (an exact search over ``k_out``; the leading-block energies come from one 2-D prefix
  sum), each bounded only by its own side.
* ``hybrid`` (test 9): ``shared`` plus a per-layer residual ``B_l C_l`` of rank ``r``, the
  top-r SVD of the whitened basis error ``W_l S − U A_l V^T``, mapped back by ``S^+``.
* ``svd`` (SVD-LLM's truncation-aware whitening, per layer and per linear module; the
  seed's per-layer baseline; fine-tuned it is test 6's free-factor control): per-layer
  ``S_l = C_l^{1/2}``, truncated SVD of ``W_l S_l``: ``W_l ≈ (U_k Σ_k)(V_k^T S_l^+)``.
* ``basis-sharing`` (see :mod:`.basis_sharing`): one input basis per group of
  consecutive layers with per-layer coefficients.

The per-layer ``energy`` is the functional energy kept under the layer's own input
statistics, ``1 − ||(W − Ŵ) S_l||² / ||W S_l||²``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from structlm.hf.linalg import energy_weighted_basis, psd_roots, thin_svd
from structlm.share.compress.ranks import TypeRanks

__all__ = ["RootCache", "TypeFactors", "best_rectangular_ranks", "factorize_shared",
           "factorize_svd", "kept_energy"]


class RootCache:
    """``C^{1/2}`` and ``C^{-1/2}`` of input second moments, one ``eigh`` each, reused by
    every type that reads the same matrix (Q, K and V read one site)."""

    def __init__(self, floor: float) -> None:
        self.floor = floor
        self._roots: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}

    def get(self, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(C^{1/2}, C^{-1/2})`` (the cache keeps ``C`` alive, so its id stays unique)."""
        if id(C) not in self._roots:
            self._roots[id(C)] = (C, psd_roots(C, self.floor))
        return self._roots[id(C)][1]


@dataclass
class TypeFactors:
    """Factors of one matrix type for every layer, ready to build modules."""

    method: str
    """The method that produced them: ``shared``, ``hybrid``, ``svd`` or ``basis-sharing``."""
    ranks: TypeRanks
    groups: list[list[int]] = field(default_factory=list)
    """Layers that share a basis (``basis-sharing``; one group of all layers for
    ``shared``/``hybrid``; one layer each for ``svd``)."""
    parts: int = 1
    """Row blocks factorised separately (a gated MLP-in under ``svd``/``basis-sharing``)."""
    bases: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per group: ``P`` ``(k_in, in)`` and ``U`` ``(out, k_out)`` (``shared``/``hybrid``),
    or ``P0``, ``P1``, … per part (``basis-sharing``)."""
    per_layer: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per layer: ``core`` (+ ``res_b``, ``res_c``) / ``B0``, ``C0``, … / ``D0``, …"""
    energy: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


def kept_energy(W: torch.Tensor, What: torch.Tensor, root: torch.Tensor) -> float:
    """``1 − ||(W − Ŵ) R||² / ||W R||²`` with ``R = C^{1/2}`` (float64)."""
    err = ((W.double() - What.double()) @ root).pow(2).sum()
    return float(1.0 - err / (W.double() @ root).pow(2).sum())


def factorize_svd(weights: list[torch.Tensor], Cs: list[torch.Tensor], k: int,
                  parts: int = 1, floor: float = 1e-6,
                  roots: RootCache | None = None) -> TypeFactors:
    """Per-layer whitened truncated SVD of rank ``k`` (each of ``parts`` row blocks on its
    own, as SVD-LLM treats ``gate_proj`` and ``up_proj``)."""
    out, inn = weights[0].shape
    op = out // parts
    if not 1 <= k <= min(op, inn):
        raise ValueError(f"svd rank k={k} must be in [1, {min(op, inn)}] for ({op}, {inn})")
    tf = TypeFactors("svd", TypeRanks(k, k), [[i] for i in range(len(weights))], parts)
    for w, c in zip(weights, Cs, strict=True):
        w = w.double()
        root, inv_root = (roots or RootCache(floor)).get(c)
        entry, rows = {}, []
        for p in range(parts):
            U, S, Vh = thin_svd(w[p * op:(p + 1) * op] @ root)
            entry[f"B{p}"], entry[f"C{p}"] = U[:, :k] * S[:k], Vh[:k] @ inv_root
            rows.append(entry[f"B{p}"] @ entry[f"C{p}"])
        tf.per_layer.append(entry)
        tf.energy.append(kept_energy(w, torch.cat(rows), root))
    return tf


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


def factorize_shared(method: str, weights: list[torch.Tensor], Cs: list[torch.Tensor],
                     ranks: TypeRanks | None = None, budget: float | None = None,
                     floor: float = 1e-6, roots: RootCache | None = None) -> TypeFactors:
    """``shared`` / ``hybrid`` factors with the given ``ranks``, or the energy-optimal
    ``(k_out, k_in)`` under ``budget`` (the hybrid's residual rank comes from ``ranks.r``
    either way; pass ``TypeRanks(0, 0, r)`` with a budget)."""
    if method not in ("shared", "hybrid"):
        raise ValueError(f"factorize_shared handles shared and hybrid, not {method!r}")
    out, inn = weights[0].shape
    L = len(weights)
    r = ranks.r if (ranks is not None and method == "hybrid") else 0
    if not 0 <= r <= min(out, inn):
        raise ValueError(f"residual rank r={r} must be in [0, {min(out, inn)}]")
    W = [w.double() for w in weights]
    C = sum(c.double() for c in Cs) / L
    S, S_inv = psd_roots(C, floor)
    Wh = [w @ S for w in W]
    roots = roots or RootCache(floor)
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
    for w, wh, c in zip(W, Wh, Cs, strict=True):
        A = U.T @ wh @ V  # (k_out, k_in)
        entry = {"core": A}
        What = U @ A @ tf.bases[0]["P"]
        if method == "hybrid" and r > 0:
            E = wh - U @ A @ V.T  # whitened basis error
            Ue, Se, Vhe = thin_svd(E)
            entry["res_b"], entry["res_c"] = Ue[:, :r] * Se[:r], Vhe[:r] @ S_inv
            What = What + entry["res_b"] @ entry["res_c"]
            res_cover.append(float(Se[:r].pow(2).sum() / Se.pow(2).sum().clamp_min(1e-300)))
        tf.per_layer.append(entry)
        tf.energy.append(kept_energy(w, What, roots.get(c)[0]))
    if res_cover:
        tf.info["residual_share_of_basis_error"] = res_cover
    return tf
