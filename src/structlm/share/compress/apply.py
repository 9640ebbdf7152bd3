"""Compress a model in place: factorise the chosen matrix types and swap the modules
through the adapter; honest parameter accounting."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..adapters import MatrixType, ModelAdapter, parse_types
from ..calibration import Calibration
from ..configs import dataclass_from_dict
from .factorize import METHODS, TypeFactors, factorize_type, rank_for_budget, stored_parameters
from .modules import LowRankLinear, OneSidedLinear, SharedBasis, SharedBasisLinear

__all__ = ["CompressionConfig", "build_modules", "compress_model", "solve_ranks"]


@dataclass
class CompressionConfig:
    """One compression (a YAML file or CLI flags fill it)."""

    method: str = "shared"
    """``shared`` | ``hybrid`` | ``svd`` | ``onesided`` (see ``factorize``)."""
    types: str = "attn"
    """Matrix types to compress: ``attn``, ``mlp``, ``all`` or ``q,k,v,o,mlp_in,mlp_out``."""
    k_fraction: float = 0.25
    """Rank k = k_fraction × hidden size (the seed's d/4), capped at min(out, in)."""
    ranks: dict[str, int] = field(default_factory=dict)
    """Per-type rank overrides, e.g. ``{"q": 96}``."""
    residual_rank: int = 32
    """Rank r of the hybrid's per-layer residual."""
    target_reduction: float | None = None
    """If set (e.g. 0.2): remove this fraction of the compressed matrices' parameters;
    k is solved per type (r stays ``residual_rank`` for the hybrid)."""
    eig_floor: float = 1e-6
    """Relative eigenvalue floor of the whitening roots."""
    budget: str = "pooled"
    """With ``target_reduction``: ``pooled`` (one budget for all compressed types; what
    a rank-capped type cannot use goes to the others) or ``per_type``."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}: expected one of {METHODS}")
        if self.target_reduction is not None and not 0 < self.target_reduction < 1:
            raise ValueError(f"target_reduction must be in (0, 1), got {self.target_reduction}")
        if self.budget not in ("pooled", "per_type"):
            raise ValueError(f"budget must be 'pooled' or 'per_type', got {self.budget!r}")
        parse_types(self.types)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CompressionConfig:
        return dataclass_from_dict(cls, raw)


def solve_ranks(adapter: ModelAdapter, cfg: CompressionConfig) -> dict[MatrixType, int]:
    """Rank ``k`` per compressed type from the config.

    With ``target_reduction`` and ``budget="pooled"`` (the default) the budget is the
    whole of ``(1 - reduction) ×`` the compressed matrices' parameters: each type starts
    from its own share, and what a type cannot use (its rank is capped at
    ``min(out, in)``, e.g. SmolLM2's 192×576 K and V under shared bases) goes to the
    others, scaled in proportion (bisection on a common factor), no type storing more
    than its dense matrices. ``budget="per_type"`` gives every type exactly its share."""
    L = adapter.num_layers
    types = parse_types(cfg.types)
    shapes = {t: tuple(adapter.layers[0].weight(t).shape) for t in types}
    writer = {t: adapter.writes_residual(t) for t in types}
    r = cfg.residual_rank if cfg.method == "hybrid" else 0
    ranks: dict[MatrixType, int] = {}
    solve = []
    for t in types:
        if t.value in cfg.ranks:
            ranks[t] = int(cfg.ranks[t.value])
        elif cfg.target_reduction is None:
            ranks[t] = round(cfg.k_fraction * adapter.hidden_size)
        else:
            solve.append(t)
    if solve:
        assert cfg.target_reduction is not None
        share = {t: (1 - cfg.target_reduction) * L * shapes[t][0] * shapes[t][1]
                 for t in solve}

        def ks(factor: float) -> dict[MatrixType, int]:  # never above a type's own size
            return {t: rank_for_budget(cfg.method, L, *shapes[t],
                                       min(factor * share[t], L * shapes[t][0] * shapes[t][1]),
                                       r, writer[t]) for t in solve}

        def stored(k: dict[MatrixType, int]) -> float:
            return sum(stored_parameters(cfg.method, L, *shapes[t], k[t], r, writer[t])
                       for t in solve)

        best = ks(1.0)
        if cfg.budget == "pooled":
            total = sum(share.values())
            hi = max(stored_parameters(cfg.method, L, *shapes[t], min(shapes[t]), r, writer[t])
                     / share[t] for t in solve)
            if stored(ks(hi)) <= total:
                best = ks(hi)
            else:
                lo = 1.0
                for _ in range(40):
                    mid = (lo + hi) / 2
                    if stored(ks(mid)) <= total:
                        lo = mid
                    else:
                        hi = mid
                best = ks(lo)
        ranks.update(best)
    return {t: max(1, min(ranks[t], *shapes[t])) for t in types}


def build_modules(factors: TypeFactors, biases: list[torch.Tensor | None]) -> list[nn.Module]:
    """One module per layer from ``factors`` (layers of one type share the basis)."""
    if factors.method == "svd":
        return [LowRankLinear(e["B"], e["C"], b)
                for e, b in zip(factors.per_layer, biases, strict=True)]
    if factors.method == "onesided":
        basis = SharedBasis(factors.P, None)
        return [OneSidedLinear(basis, e["D"], b)
                for e, b in zip(factors.per_layer, biases, strict=True)]
    basis = SharedBasis(factors.P, factors.U)
    return [SharedBasisLinear(basis, e["core"], b,
                              (e["res_b"], e["res_c"]) if "res_b" in e else None)
            for e, b in zip(factors.per_layer, biases, strict=True)]


def compress_model(adapter: ModelAdapter, cal: Calibration, cfg: CompressionConfig,
                   progress: Any = None) -> dict[str, Any]:
    """Factorise ``cfg.types`` in every layer and replace the modules in place; returns
    the accounting (original vs stored parameters per type and for the model), ranks
    and per-layer kept energy."""
    L = adapter.num_layers
    ranks = solve_ranks(adapter, cfg)
    report: dict[str, Any] = {"config": dataclasses.asdict(cfg), "types": {}}
    total_params = sum(p.numel() for p in adapter.model.parameters())
    orig_sum = stored_sum = 0
    for t, k in ranks.items():
        weights = adapter.weights(t)
        Cs = [cal.C(i, t) for i in range(L)]
        writer = adapter.writes_residual(t)
        r = cfg.residual_rank if cfg.method == "hybrid" else 0
        factors = factorize_type(cfg.method, weights, Cs, k, r, writer, cfg.eig_floor)
        biases = [adapter.layers[i].bias(t) for i in range(L)]
        for layer, mod in zip(adapter.layers, build_modules(factors, biases), strict=True):
            layer.replace(t, mod)
        out, inn = weights[0].shape
        original = L * out * inn
        stored = stored_parameters(factors.method, L, out, inn, k, r)
        orig_sum, stored_sum = orig_sum + original, stored_sum + stored
        report["types"][t.value] = {
            "method": factors.method, "k": k, "r": r, "shape": [out, inn],
            "original_parameters": original, "stored_parameters": stored,
            "ratio": original / stored, "energy_kept": factors.energy,
            "mean_energy_kept": sum(factors.energy) / L, **factors.info}
        if progress is not None:
            progress.update(1)
    report.update(original_parameters=orig_sum, stored_parameters=stored_sum,
                  ratio=orig_sum / max(stored_sum, 1), reduction=1 - stored_sum / orig_sum,
                  model_parameters_before=total_params,
                  model_parameters_after=total_params - orig_sum + stored_sum)
    return report
