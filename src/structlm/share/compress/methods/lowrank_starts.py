"""The seed's own test-6 control: per-layer free factors ``W_l ≈ B_l C_l`` at the shared
basis's storage, trained with plain AdamW at an absolute rate (the seed: "per-layer
``B_l·C_l``, rank 40, same ~737k stored parameters, identical training"), from two starts:

* ``lowrank-svd`` — the plain truncated SVD of ``W_l`` (no whitening):
  ``B = U_k Σ_k^{1/2}``, ``C = Σ_k^{1/2} V_kᵀ`` (balanced, so neither factor starts at a
  scale the other must undo);
* ``lowrank-random`` — Gaussian factors with no information about ``W_l``, scaled so that
  ``E ||B C||_F² = ||W_l||_F²`` (each entry ``N(0, σ²)`` with
  ``σ⁴ = ||W_l||²_F / (out · in · k)``), drawn from torch's global generator (the
  experiment seeds it with the run's seed before compressing, so every seed has its own
  start).

Storage, modules and MACs are ``svd-llm-w``'s (per-layer :class:`LowRankLinear`); only
the start differs. Neither method reads the calibration statistics.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from structlm.hf.linalg import thin_svd
from structlm.share.compress.factorize import RootCache, TypeFactors, TypeRanks, kept_energy
from structlm.share.compress.methods.base import TypePlan, register
from structlm.share.compress.methods.svd import SvdLlmWMethod

__all__ = [
    "CONTROL_METHODS",
    "LOWRANK_RANDOM_METHOD",
    "LOWRANK_SVD_METHOD",
    "factorize_lowrank_start",
]


def factorize_lowrank_start(weights: list[torch.Tensor], Cs: Sequence[torch.Tensor], k: int,
                            parts: int, start: str, method: str) -> TypeFactors:
    """Per-layer factors of rank ``k`` from the ``start`` (``"svd"``: plain truncated SVD,
    balanced; ``"random"``: scaled Gaussian), each of ``parts`` row blocks on its own."""
    out, inn = weights[0].shape
    op = out // parts
    if not 1 <= k <= min(op, inn):
        raise ValueError(f"rank k={k} must be in [1, {min(op, inn)}] for ({op}, {inn})")
    if start not in ("svd", "random"):
        raise ValueError(f"start must be 'svd' or 'random', got {start!r}")
    tf = TypeFactors(method, TypeRanks(k, k), [[i] for i in range(len(weights))], parts)
    for w, c in zip(weights, Cs, strict=True):
        w = w.double()
        entry, rows = {}, []
        for p in range(parts):
            block = w[p * op:(p + 1) * op]  # (op, in)
            if start == "svd":
                U, S, Vh = thin_svd(block)
                root = S[:k].sqrt()
                B, C = U[:, :k] * root, root[:, None] * Vh[:k]
            else:
                sigma = (float(block.pow(2).sum()) / (op * inn * k)) ** 0.25
                B = sigma * torch.randn(op, k, dtype=torch.float64)
                C = sigma * torch.randn(k, inn, dtype=torch.float64)
            entry[f"B{p}"], entry[f"C{p}"] = B, C
            rows.append(B @ C)
        tf.per_layer.append(entry)
        tf.energy.append(kept_energy(w, torch.cat(rows), c))
    return tf


class LowRankStartMethod(SvdLlmWMethod):
    """Per-layer ``B_l C_l`` from a plain-SVD or random start (module docstring)."""

    def __init__(self, name: str, start: str) -> None:
        self.name = name
        self.start = start

    def factorize(self, plan: TypePlan, weights: list[torch.Tensor], Cs: Sequence[torch.Tensor],
                  floor: float, roots: RootCache) -> TypeFactors:
        """:func:`factorize_lowrank_start` at the plan's rank (``floor``, ``roots``:
        unused, the start reads no statistics)."""
        assert plan.ranks is not None
        return factorize_lowrank_start(weights, Cs, plan.ranks.k, plan.parts, self.start,
                                       self.name)


LOWRANK_SVD_METHOD = register(LowRankStartMethod("lowrank-svd", "svd"))
"""Per-layer free factors from the plain (unwhitened) truncated SVD."""
LOWRANK_RANDOM_METHOD = register(LowRankStartMethod("lowrank-random", "random"))
"""Per-layer free factors from a random start."""

CONTROL_METHODS = (LOWRANK_SVD_METHOD.name, LOWRANK_RANDOM_METHOD.name)
"""Methods that exist as the seed's test-6 control only (not in the default method list)."""
