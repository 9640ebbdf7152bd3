"""Basis Sharing (Wang et al., 2024, "Basis Sharing: Cross-Layer Parameter Sharing for
Large Language Model Compression"; public code TUDa-HWAI/Basis_Sharing), in the
project's ``(out, in)`` orientation.

What the paper's code does, and this module follows:

* layers are cut into groups of ``group_size`` consecutive layers (``group.py`` /
  ``model_factory.py``: ``[[0, 1], [2, 3], …]``, a remainder forms a last smaller group);
  its LLaMA-2-7B configs at 20–50% use ``group_size: 2``;
* the *shared part* (``share_part: v, k, q, up, gate``) gets one basis per type and group,
  each of gate and up its own; the *private part* (``private_part: down, o``) is
  per-layer SVD-LLM (the same code with groups of one layer);
* whitening by the group's summed ``XᵀX`` (``Calib.get_s_inv_s``), SVD of the whitened
  stack of the group's matrices: with ``W_g = [W_1; …; W_n]`` ``(n·out, in)`` and
  ``S = (Σ_{l∈g} C_l)^{1/2}``, ``W_g S = U Σ Vᵀ``; the basis ``P = V_kᵀ S^{-1}``
  ``(k, in)`` is shared, each layer keeps its rows of ``U_k Σ_k`` as coefficients
  ``D_l`` ``(out, k)``: ``W_l ≈ D_l P`` (the code's ``Basis`` then ``Coefficient``);
* the rank from the compression ratio per type, ``k = ⌊(1 − ratio)·in·out·n / (in + out·n)⌋``
  (``utils.compute_num_basis``) — :func:`~.ranks.solve_basis_sharing_rank` gives the same
  ``k`` when the layers divide into groups;
* the optional *update* (``update_model``, off in its configs): the compressed model is
  run on the calibration text again, and with the new inputs' group-summed ``X'ᵀX'`` each
  coefficient is refitted in closed form to the original weights,
  ``D_g = W_g X'ᵀX' Pᵀ (P X'ᵀX' Pᵀ)^{-1}`` — for the private SVD parts too.

Where it differs (also in docs/share.md): the whitening root is the symmetric
``C^{1/2}`` with a relative eigenvalue floor instead of a Cholesky factor with an
eigenvalue shift (the truncated product ``D P`` is the same for any square root of the
same matrix; only the regularisation of a singular ``C`` differs); the singular values sit
in the coefficients rather than in the basis (same product; it matters only for how a
fine-tuning step scales); a remainder group gets the largest rank that fits its share
instead of the common rank (which would store more than the budget); fine-tuning trains
the coefficients (the paper's code fine-tunes with LoRA).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from structlm.hf.linalg import energy_weighted_basis, psd_inv_sqrt, psd_roots, psd_sqrt
from structlm.share.compress.factorize import RootCache, TypeFactors, kept_energy
from structlm.share.compress.ranks import TypeRanks, max_basis_rank

__all__ = ["factorize_basis_sharing", "update_coefficients"]


def factorize_basis_sharing(weights: list[torch.Tensor], Cs: list[torch.Tensor], k: int,
                            groups: list[list[int]], parts: int = 1,
                            floor: float = 1e-6, roots: RootCache | None = None
                            ) -> TypeFactors:
    """Shared input bases of size ``k`` per group (and part) with per-layer coefficients;
    a group whose stacked matrix has fewer directions keeps all of them."""
    out, inn = weights[0].shape
    op = out // parts
    top = max(max_basis_rank(inn, len(g), op) for g in groups)
    if not 1 <= k <= top:
        raise ValueError(f"basis size k={k} must be in [1, {top}] for ({op}, {inn}) in "
                         f"groups of {sorted({len(g) for g in groups})}")
    if sorted(i for g in groups for i in g) != list(range(len(weights))):
        raise ValueError(f"groups {groups} must cover layers 0..{len(weights) - 1} once each")
    tf = TypeFactors("basis-sharing", TypeRanks(k, k), [list(g) for g in groups], parts)
    tf.per_layer = [{} for _ in weights]
    W = [w.double() for w in weights]
    for g in groups:
        C = sum(Cs[i].double() for i in g) / len(g)  # the group's XᵀX up to a scale
        S, S_inv = psd_roots(C, floor) if len(g) > 1 else (roots or RootCache(floor)).get(
            Cs[g[0]])
        kg = min(k, max_basis_rank(inn, len(g), op))
        basis = {}
        for p in range(parts):
            Wh = [W[i][p * op:(p + 1) * op] @ S for i in g]
            V = energy_weighted_basis(Wh, kg, "input")  # (in, kg): top of the stack's SVD
            basis[f"P{p}"] = V.T @ S_inv  # (kg, in)
            for i, wh in zip(g, Wh, strict=True):
                tf.per_layer[i][f"D{p}"] = wh @ V  # (op, kg)
        tf.bases.append(basis)
    for i, g in enumerate(_group_of(groups, len(W))):
        What = torch.cat([tf.per_layer[i][f"D{p}"] @ tf.bases[g][f"P{p}"] for p in range(parts)])
        tf.energy.append(kept_energy(W[i], What, (roots or RootCache(floor)).get(Cs[i])[0]))
    tf.info["group_sizes"] = [len(g) for g in groups]
    return tf


def _group_of(groups: list[list[int]], L: int) -> list[int]:
    index = [0] * L
    for gi, g in enumerate(groups):
        for i in g:
            index[i] = gi
    return index


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
                        new_Cs: list[torch.Tensor], groups: list[list[int]], parts: int,
                        floor: float = 1e-6) -> dict[str, Any]:
    """Basis Sharing's update step for one matrix type: refit every layer's coefficients
    (:class:`~.modules.OneSidedLinear` ``D``, or the output factor ``B`` of a private
    :class:`~.modules.LowRankLinear`) to the original weights ``originals`` under the
    compressed model's inputs ``new_Cs`` (summed over the group, as the paper's code
    does). ``modules``: one per layer (a :class:`~structlm.hf.adapters.ConcatProjection`
    of ``parts`` such modules for a gated MLP-in). Returns the whitened error before and
    after, per layer."""
    from structlm.hf.adapters import ConcatProjection
    from structlm.nn.factorized import LowRankLinear, OneSidedLinear

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
