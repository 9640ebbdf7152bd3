"""Basis Sharing (Wang et al., 2024, "Basis Sharing: Cross-Layer Parameter Sharing for
Large Language Model Compression"; public code TUDa-HWAI/Basis_Sharing), in the
project's ``(out, in)`` orientation.

What the paper's code does, and this module follows:

* layers are cut into groups of ``group_size`` consecutive layers (``group.py`` /
  ``model_factory.py``: ``[[0, 1], [2, 3], …]``, a remainder forms a last smaller group);
  its LLaMA-2-7B configs at 20–50% use ``group_size: 2``;
* the *shared part* (``share_part: v, k, q, up, gate``) gets one basis per type and group,
  each of gate and up its own; the *private part* (``private_part: down, o``) is
  per-layer SVD-LLM's whitened truncation without SVD-LLM's update (the same code with
  groups of one layer: ``svd-llm-w`` here);
* whitening by the group's summed ``XᵀX`` (``Calib.get_s_inv_s``), SVD of the whitened
  stack of the group's matrices: with ``W_g = [W_1; …; W_n]`` ``(n·out, in)`` and
  ``S = (Σ_{l∈g} C_l)^{1/2}``, ``W_g S = U Σ Vᵀ``; the basis ``P = V_kᵀ S^{-1}``
  ``(k, in)`` is shared, each layer keeps its rows of ``U_k Σ_k`` as coefficients
  ``D_l`` ``(out, k)``: ``W_l ≈ D_l P`` (the code's ``Basis`` then ``Coefficient``);
* the rank from the compression ratio per type, ``k = ⌊(1 − ratio)·in·out·n / (in + out·n)⌋``
  (``utils.compute_num_basis``) — :func:`solve_basis_sharing_rank` gives the same ``k``
  when the layers divide into groups;
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

Stored parameters ``Σ_groups Σ_parts k_g·in + n_g k_g out_p`` with
``k_g = min(k, in, n_g out_p)``; MACs per token ``parts · Σ_groups n_g k_g (in + out_p)``
(every layer maps its own input onto the group's basis).

``onesided-all-layers`` is the same method with one group of all layers (a configuration
of :class:`BasisSharingMethod`, not a file of its own: only the grouping differs, and its
types are recorded as ``basis-sharing``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from torch import nn

from structlm.config import ConfigError, NonEmpty, Range, validated
from structlm.hf.adapters import ConcatProjection, MatrixType, ModelAdapter, parse_types
from structlm.hf.calibration import Calibration
from structlm.hf.linalg import energy_weighted_basis
from structlm.nn.factorized import OneSidedLinear, SharedBasis
from structlm.share.compress.factorize import (
    RootCache,
    TypeFactors,
    TypeRanks,
    kept_energy,
    meta_tensor,
    owned_moment,
    part_rows,
    split_bias,
)
from structlm.share.compress.methods.base import (
    CompressionMethod,
    LayoutOptions,
    TypePlan,
    register,
)
from structlm.share.compress.methods.refit import update_coefficients
from structlm.share.compress.methods.svd import SVD_LLM_W_METHOD

__all__ = ["BASIS_SHARING", "BASIS_SHARING_METHOD", "DEFAULT_GROUP_SIZE",
           "ONESIDED_ALL_LAYERS_METHOD", "BasisSharingMethod", "BasisSharingOptions",
           "consecutive_groups", "factorize_basis_sharing", "max_basis_rank",
           "solve_basis_sharing_rank", "update_coefficients", "update_model"]


DEFAULT_GROUP_SIZE = 2
"""Consecutive layers per shared basis in the paper's LLaMA configs."""


@dataclass
@validated
class BasisSharingOptions:
    """The options of ``basis-sharing`` (and ``onesided-all-layers``, which reads
    ``shared_types`` and ``update``): ``CompressionConfig.basis_sharing``."""

    group_size: Annotated[int, Range(ge=1)] = DEFAULT_GROUP_SIZE
    """Consecutive layers per shared basis, at most the model's layers (the paper's
    LLaMA configs use 2; ``onesided-all-layers`` uses all layers)."""
    shared_types: Annotated[str, NonEmpty()] = "q,k,v,mlp_in"
    """The types whose basis is shared (the paper's ``share_part``: q, k, v, up, gate);
    the other compressed types are per-layer ``svd-llm-w`` (its ``private_part``: o,
    down; whitening only, as its code does)."""
    update: bool = False
    """After compression, refit every coefficient in closed form on the compressed
    model's own inputs (the paper's optional update step; off in its configs). Costs one
    more calibration pass."""

    def __post_init__(self) -> None:
        """``shared_types`` names known types (each field's range: ``@validated``)."""
        try:
            parse_types(self.shared_types)
        except ValueError as e:
            raise ConfigError(f"shared_types: {e}") from None


def consecutive_groups(L: int, group_size: int) -> list[list[int]]:
    """Layers ``0..L-1`` in groups of ``group_size`` consecutive layers; a remainder forms
    a last, smaller group (as in the Basis Sharing code)."""
    if not 1 <= group_size:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    g = min(group_size, L)
    return [list(range(i, min(i + g, L))) for i in range(0, L, g)]


def max_basis_rank(inn: int, n: int, out_part: int) -> int:
    """Largest useful one-sided basis of a group of ``n`` layers: the rank of the stacked
    ``(n·out_part, in)`` matrix, ``min(in, n·out_part)``."""
    return min(inn, n * out_part)


def _stored(out: int, inn: int, k: int, group_sizes: list[int], parts: int) -> int:
    op = part_rows(out, parts)
    return parts * sum(min(k, max_basis_rank(inn, n, op)) * (inn + n * op)
                       for n in group_sizes)


def solve_basis_sharing_rank(out: int, inn: int, group_sizes: list[int], parts: int,
                             budget: float) -> int:
    """Largest basis size ``k`` whose ``basis-sharing`` storage fits ``budget`` (groups
    whose stacked matrix has fewer than ``k`` directions keep all of theirs)."""
    op = out // parts
    top = max(max_basis_rank(inn, n, op) for n in group_sizes)

    def stored(k: int) -> int:
        return _stored(out, inn, k, group_sizes, parts)

    if stored(1) > budget:
        raise ValueError(f"a budget of {budget:,.0f} parameters cannot hold a rank-1 shared "
                         f"basis of ({out}, {inn}) in groups {group_sizes}")
    lo, hi = 1, top  # stored() is non-decreasing in k: bisection for the last k that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if stored(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def factorize_basis_sharing(weights: list[torch.Tensor], Cs: Sequence[torch.Tensor], k: int,
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
    tf = TypeFactors(BASIS_SHARING_METHOD.name, TypeRanks(k, k), [list(g) for g in groups],
                     parts)
    tf.per_layer = [{} for _ in weights]
    W = [w.double() for w in weights]
    for g in groups:
        C = owned_moment(Cs, g[0]).double()  # the group's XᵀX up to a scale, summed in place
        for i in g[1:]:
            C.add_(Cs[i])
        S, S_inv = (roots or RootCache(floor)).get(C.div_(len(g)), consume=True)
        del C  # (the roots are what the group needs: moments are dim² each)
        kg = min(k, max_basis_rank(inn, len(g), op))
        basis = {}
        for p in range(parts):
            Wh = [W[i][p * op:(p + 1) * op] @ S for i in g]
            V = energy_weighted_basis(Wh, kg, "input")  # (in, kg): top of the stack's SVD
            basis[f"P{p}"] = V.T @ S_inv  # (kg, in)
            for i, wh in zip(g, Wh, strict=True):
                tf.per_layer[i][f"D{p}"] = wh @ V  # (op, kg)
            del Wh
        tf.bases.append(basis)
        del S, S_inv
    for i, g in enumerate(_group_of(groups, len(W))):
        What = torch.cat([tf.per_layer[i][f"D{p}"] @ tf.bases[g][f"P{p}"] for p in range(parts)])
        tf.energy.append(kept_energy(W[i], What, Cs[i]))
    tf.info["group_sizes"] = [len(g) for g in groups]
    return tf


def _group_of(groups: list[list[int]], L: int) -> list[int]:
    index = [0] * L
    for gi, g in enumerate(groups):
        for i in g:
            index[i] = gi
    return index


def update_model(adapter: ModelAdapter, cal: Calibration, plans: list[TypePlan],
                 originals: dict[MatrixType, list[torch.Tensor]], tokens: torch.Tensor,
                 floor: float) -> dict[str, Any]:
    """Basis Sharing's update: calibrate the compressed model on ``tokens``, refit the
    coefficients of every planned type (:func:`update_coefficients`); the summed whitened
    error before and after, per type."""
    from structlm.hf.calibration import calibrate

    seq_len = int(cal.meta.get("seq_len", 512))
    new = calibrate(adapter, tokens, seq_len=seq_len, progress=False,
                    meta={"purpose": "basis-sharing update"})
    out: dict[str, Any] = {}
    for plan in plans:
        mods = [layer.module(plan.type) for layer in adapter.layers]
        Cs = [new.C(i, plan.type) for i in range(adapter.num_layers)]
        res = update_coefficients(mods, originals[plan.type], Cs, plan.groups, plan.parts,
                                  floor)
        out[plan.type.value] = {"error_before": sum(res["error_before"]),
                                "error_after": sum(res["error_after"])}
    return out


class BasisSharingMethod(CompressionMethod):
    """One input basis per group of consecutive layers (``group_size`` of its options, or
    all layers with ``all_layers``) for the ``shared_types``; the other types per-layer
    ``svd-llm-w`` (whitening only, as the Basis Sharing code's private part)."""

    two_sided = False
    shares_across_layers = True
    splits_row_blocks = True

    def __init__(self, name: str, all_layers: bool = False) -> None:
        self.name = name
        self.all_layers = all_layers

    def layout(self, t: MatrixType, num_layers: int, options: LayoutOptions
               ) -> tuple[CompressionMethod, list[list[int]]]:
        """``basis-sharing`` in consecutive groups for a shared type, ``svd-llm-w`` per
        layer for a private one."""
        bs = options.basis_sharing
        if t not in set(parse_types(bs.shared_types)):
            return SVD_LLM_W_METHOD, SVD_LLM_W_METHOD.default_groups(num_layers)
        size = num_layers if self.all_layers else bs.group_size
        return BASIS_SHARING_METHOD, consecutive_groups(num_layers, size)

    def default_ranks(self, k: int, shape: tuple[int, int], group_sizes: list[int],
                      parts: int, r: int) -> TypeRanks:
        """``k`` as far as the largest group's stacked matrix allows."""
        out, inn = shape
        top = max(max_basis_rank(inn, n, out // parts) for n in group_sizes)
        return TypeRanks(min(k, top), min(k, top))

    def budget_ranks(self, shape: tuple[int, int], group_sizes: list[int], parts: int,
                     budget: float, r: int) -> TypeRanks | None:
        """:func:`solve_basis_sharing_rank`."""
        k = solve_basis_sharing_rank(*shape, group_sizes, parts, budget)
        return TypeRanks(k, k)

    def factorize(self, plan: TypePlan, weights: list[torch.Tensor], Cs: Sequence[torch.Tensor],
                  floor: float, roots: RootCache) -> TypeFactors:
        """:func:`factorize_basis_sharing` at the plan's basis size and groups."""
        assert plan.ranks is not None
        return factorize_basis_sharing(weights, Cs, plan.ranks.k, plan.groups, plan.parts,
                                       floor, roots)

    def build_modules(self, factors: TypeFactors, biases: list[torch.Tensor | None]
                      ) -> list[nn.Module]:
        """:class:`OneSidedLinear` per layer (per part, concatenated) around its group's
        :class:`SharedBasis`."""
        parts = factors.parts
        mods: list[nn.Module] = [nn.Identity() for _ in biases]
        for g, basis in zip(factors.groups, factors.bases, strict=True):
            shared = [SharedBasis(basis[f"P{p}"], None) for p in range(parts)]
            for i in g:
                pieces = [OneSidedLinear(shared[p], factors.per_layer[i][f"D{p}"], bp)
                          for p, bp in enumerate(split_bias(biases[i], parts))]
                mods[i] = pieces[0] if parts == 1 else ConcatProjection(pieces)
        return mods

    def stored_parameters(self, out: int, inn: int, ranks: TypeRanks,
                          group_sizes: list[int], parts: int = 1) -> int:
        """``Σ_groups Σ_parts k_g·in + n_g k_g out_p``."""
        return _stored(out, inn, ranks.k, group_sizes, parts)

    def token_macs(self, out: int, inn: int, ranks: TypeRanks, group_sizes: list[int],
                   parts: int = 1) -> int:
        """``parts · Σ_groups n_g k_g (in + out_p)``."""
        op = part_rows(out, parts)
        return parts * sum(n * min(ranks.k, max_basis_rank(inn, n, op)) * (inn + op)
                           for n in group_sizes)

    def placeholder(self, shape: tuple[int, int], ranks: TypeRanks, groups: list[list[int]],
                    parts: int) -> TypeFactors:
        """Meta ``P{p}`` ``(k_g, in)`` per group and ``D{p}`` ``(out_p, k_g)`` per layer."""
        out, inn = shape
        op, k = out // parts, ranks.k
        tf = TypeFactors(self.name, ranks, groups, parts)
        ks = [min(k, inn, len(g) * op) for g in groups]
        tf.bases = [{f"P{p}": meta_tensor(kg, inn) for p in range(parts)} for kg in ks]
        tf.per_layer = [{} for g in groups for _ in g]
        for g, kg in zip(groups, ks, strict=True):
            for i in g:
                tf.per_layer[i] = {f"D{p}": meta_tensor(op, kg) for p in range(parts)}
        return tf

    def update(self, adapter: ModelAdapter, cal: Calibration, plans: list[TypePlan],
               originals: dict[MatrixType, list[torch.Tensor]], tokens: torch.Tensor,
               floor: float) -> dict[str, Any]:
        """The paper's optional update step (:func:`update_model`)."""
        return update_model(adapter, cal, plans, originals, tokens, floor)


BASIS_SHARING_METHOD = register(BasisSharingMethod("basis-sharing"))
"""Basis Sharing with groups of ``group_size`` consecutive layers."""
ONESIDED_ALL_LAYERS_METHOD = register(BasisSharingMethod("onesided-all-layers",
                                                         all_layers=True))
"""Basis Sharing's math with one group of all layers."""

BASIS_SHARING = (BASIS_SHARING_METHOD.name, ONESIDED_ALL_LAYERS_METHOD.name)
"""The names of the Basis Sharing configurations."""
