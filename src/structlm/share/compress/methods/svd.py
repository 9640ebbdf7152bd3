"""``svd-llm-w`` ("whitened truncation"): SVD-LLM's truncation-aware whitening, per layer
and per linear module, *without* SVD-LLM's parameter update (Wang et al., 2025, "SVD-LLM:
Truncation-aware Singular Value Decomposition for Large Language Model Compression",
ICLR; its code's ``--step 1``, "whitening only"). The seed's per-layer baseline;
fine-tuned it is test 6's free-factor control; Basis Sharing's private types use it too,
as the Basis Sharing code does. SVD-LLM with its published layer-wise update is
``svd-llm`` (:mod:`.svd_llm`). Formerly named ``svd``, which still resolves here with a
``DeprecationWarning``.

Per-layer ``S_l = C_l^{1/2}``, truncated SVD of ``W_l S_l``:
``W_l ≈ (U_k Σ_k)(V_k^T S_l^+)``, each of ``parts`` row blocks on its own (a gated
MLP-in's gate and up, as SVD-LLM treats ``gate_proj`` and ``up_proj``). Rank
``k ≤ min(out_p, in)``; stored parameters and MACs per token are both
``parts · L k (out_p + in)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from structlm.hf.adapters import ConcatProjection
from structlm.hf.linalg import thin_svd
from structlm.nn.factorized import LowRankLinear
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
from structlm.share.compress.methods.base import CompressionMethod, TypePlan, register

__all__ = ["SVD_LLM_W_METHOD", "SVD_METHOD", "SvdLlmWMethod", "SvdMethod", "factorize_svd",
           "solve_svd_rank"]


def solve_svd_rank(L: int, out: int, inn: int, budget: float, parts: int = 1) -> int:
    """Largest per-layer rank ``k ≤ min(out/parts, in)`` with
    ``parts · L k (out/parts + in) ≤ budget``."""
    op = out // parts
    k = int(budget // (parts * L * (op + inn)))
    if k < 1:
        raise ValueError(f"a budget of {budget:,.0f} parameters cannot hold rank 1 of "
                         f"{L} × ({out}, {inn}) per-layer factors")
    return min(k, op, inn)


def factorize_svd(weights: list[torch.Tensor], Cs: Sequence[torch.Tensor], k: int,
                  parts: int = 1, floor: float = 1e-6,
                  roots: RootCache | None = None, method: str = "svd-llm-w") -> TypeFactors:
    """Per-layer whitened truncated SVD of rank ``k`` (each of ``parts`` row blocks on its
    own, as SVD-LLM treats ``gate_proj`` and ``up_proj``); ``method``: the name the factors
    record (``svd-llm`` starts from the same factors)."""
    out, inn = weights[0].shape
    op = out // parts
    if not 1 <= k <= min(op, inn):
        raise ValueError(f"svd rank k={k} must be in [1, {min(op, inn)}] for ({op}, {inn})")
    tf = TypeFactors(method, TypeRanks(k, k), [[i] for i in range(len(weights))], parts)
    if len(weights) != len(Cs):
        raise ValueError(f"{len(weights)} weights but {len(Cs)} moments")
    for i, w in enumerate(weights):
        w = w.double()
        # an owned copy, decomposed in its own storage (one moment less at the peak)
        root, inv_root = (roots or RootCache(floor)).get(owned_moment(Cs, i), consume=True)
        entry, rows = {}, []
        for p in range(parts):
            U, S, Vh = thin_svd(w[p * op:(p + 1) * op] @ root)
            entry[f"B{p}"], entry[f"C{p}"] = U[:, :k] * S[:k], Vh[:k] @ inv_root
            rows.append(entry[f"B{p}"] @ entry[f"C{p}"])
        del root, inv_root  # (not held while the next layer's are computed)
        tf.per_layer.append(entry)
        tf.energy.append(kept_energy(w, torch.cat(rows), Cs[i]))  # read again
    return tf


class SvdLlmWMethod(CompressionMethod):
    """Per-layer whitened truncated SVD (:func:`factorize_svd`), no update."""

    name = "svd-llm-w"
    shares_across_layers = False
    splits_row_blocks = True

    def default_ranks(self, k: int, shape: tuple[int, int], group_sizes: list[int],
                      parts: int, r: int) -> TypeRanks:
        """``k`` as far as ``min(out_p, in)`` allows."""
        out, inn = shape
        op = out // parts
        return TypeRanks(min(k, op, inn), min(k, op, inn))

    def budget_ranks(self, shape: tuple[int, int], group_sizes: list[int], parts: int,
                     budget: float, r: int) -> TypeRanks | None:
        """:func:`solve_svd_rank`."""
        k = solve_svd_rank(sum(group_sizes), *shape, budget, parts)
        return TypeRanks(k, k)

    def factorize(self, plan: TypePlan, weights: list[torch.Tensor], Cs: Sequence[torch.Tensor],
                  floor: float, roots: RootCache) -> TypeFactors:
        """:func:`factorize_svd` at the plan's rank."""
        assert plan.ranks is not None
        return factorize_svd(weights, Cs, plan.ranks.k, plan.parts, floor, roots, self.name)

    def build_modules(self, factors: TypeFactors, biases: list[torch.Tensor | None]
                      ) -> list[nn.Module]:
        """:class:`LowRankLinear` per layer (per part, concatenated)."""
        parts = factors.parts
        mods: list[nn.Module] = []
        for e, b in zip(factors.per_layer, biases, strict=True):
            pieces = [LowRankLinear(e[f"B{p}"], e[f"C{p}"], bp)
                      for p, bp in enumerate(split_bias(b, parts))]
            mods.append(pieces[0] if parts == 1 else ConcatProjection(pieces))
        return mods

    def stored_parameters(self, out: int, inn: int, ranks: TypeRanks,
                          group_sizes: list[int], parts: int = 1) -> int:
        """``parts · L k (out_p + in)``."""
        op = part_rows(out, parts)
        return parts * sum(group_sizes) * ranks.k * (op + inn)

    def token_macs(self, out: int, inn: int, ranks: TypeRanks, group_sizes: list[int],
                   parts: int = 1) -> int:
        """``parts · L k (out_p + in)`` (equal to the stored parameters)."""
        return self.stored_parameters(out, inn, ranks, group_sizes, parts)

    def placeholder(self, shape: tuple[int, int], ranks: TypeRanks, groups: list[list[int]],
                    parts: int) -> TypeFactors:
        """Meta ``B{p}`` ``(out_p, k)`` and ``C{p}`` ``(k, in)`` per layer and part."""
        out, inn = shape
        op, k = out // parts, ranks.k
        tf = TypeFactors(self.name, ranks, groups, parts)
        tf.per_layer = [{f"{x}{p}": meta_tensor(op, k) if x == "B" else meta_tensor(k, inn)
                         for p in range(parts) for x in "BC"} for g in groups for _ in g]
        return tf


SVD_LLM_W_METHOD = register(SvdLlmWMethod())
"""Per-layer whitened SVD (SVD-LLM's truncation-aware whitening, without its update)."""

SvdMethod = SvdLlmWMethod
"""Former name of :class:`SvdLlmWMethod`."""
SVD_METHOD = SVD_LLM_W_METHOD
"""Former name of :data:`SVD_LLM_W_METHOD` (the method formerly registered as ``svd``)."""
