"""Compress a model in place: factorise the chosen matrix types and swap the modules
through the adapter; honest parameter accounting."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from structlm.config import dataclass_from_dict
from structlm.hf.adapters import ConcatProjection, MatrixType, ModelAdapter, parse_types
from structlm.hf.calibration import Calibration
from structlm.nn.factorized import LowRankLinear, OneSidedLinear, SharedBasis, SharedBasisLinear
from structlm.share.compress.basis_sharing import factorize_basis_sharing
from structlm.share.compress.factorize import (
    RootCache,
    TypeFactors,
    factorize_shared,
    factorize_svd,
)
from structlm.share.compress.ranks import (
    BASIS_SHARING,
    METHODS,
    TypeRanks,
    consecutive_groups,
    solve_basis_sharing_rank,
    solve_svd_rank,
    stored_parameters,
    token_macs,
)

__all__ = ["CompressionConfig", "TypePlan", "build_modules", "compress_model", "plan_types"]


@dataclass
class CompressionConfig:
    """One compression (a YAML file or CLI flags fill it)."""

    method: str = "shared"
    """``shared`` | ``hybrid`` | ``svd`` | ``basis-sharing`` | ``onesided-all-layers``
    (see :mod:`.ranks`)."""
    types: str = "attn"
    """Matrix types to compress: ``attn``, ``mlp``, ``all`` or ``q,k,v,o,mlp_in,mlp_out``."""
    k_fraction: float = 0.25
    """Without ``target_reduction``: rank k = k_fraction × hidden size (the seed's d/4), on
    each side only as far as that side's dimension allows."""
    ranks: dict[str, Any] = field(default_factory=dict)
    """Per-type rank overrides: ``{"q": 96}`` or, for ``shared``/``hybrid``,
    ``{"k": [k_out, k_in]}``."""
    residual_rank: int = 32
    """Rank r of the hybrid's per-layer residual."""
    target_reduction: float | None = None
    """If set (e.g. 0.2): remove this fraction of every compressed type's parameters
    (per-type budget; ranks solved per method)."""
    eig_floor: float = 1e-6
    """Relative eigenvalue floor of the whitening roots."""
    budget: str = "per_type"
    """Only ``per_type`` (the Basis Sharing / SVD-LLM convention). The former ``pooled``
    budget existed to pass on what a rank capped at ``min(out, in)`` could not use; no
    rank is capped that way any more."""
    group_size: int = 2
    """``basis-sharing``: consecutive layers per shared basis (the paper's LLaMA configs
    use 2; ``onesided-all-layers`` uses all layers)."""
    shared_types: str = "q,k,v,mlp_in"
    """``basis-sharing``: the types whose basis is shared (the paper's ``share_part``:
    q, k, v, up, gate); the other compressed types are per-layer ``svd`` (its
    ``private_part``: o, down)."""
    update: bool = False
    """``basis-sharing``: after compression, refit every coefficient in closed form on the
    compressed model's own inputs (the paper's optional update step; off in its
    configs). Costs one more calibration pass."""

    def __post_init__(self) -> None:
        if self.method == "onesided":
            raise ValueError("method 'onesided' was renamed: use 'onesided-all-layers' (one "
                             "input basis across every layer) or 'basis-sharing' (groups of "
                             "consecutive layers, as in the Basis Sharing paper)")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}: expected one of {METHODS}")
        if self.target_reduction is not None and not 0 < self.target_reduction < 1:
            raise ValueError(f"target_reduction must be in (0, 1), got {self.target_reduction}")
        if self.budget != "per_type":
            raise ValueError(f"budget must be 'per_type', got {self.budget!r} (the pooled "
                             "budget was removed with the min(out, in) rank cap it served)")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be an integer >= 1, got {self.group_size!r}")
        if self.update and self.method not in BASIS_SHARING:
            raise ValueError(f"update is Basis Sharing's step: method must be one of "
                             f"{BASIS_SHARING}, got {self.method!r}")
        if not 0 < self.k_fraction <= 1:
            raise ValueError(f"k_fraction must be in (0, 1], got {self.k_fraction}")
        if self.residual_rank < 0:
            raise ValueError(f"residual_rank must be >= 0, got {self.residual_rank}")
        parse_types(self.types)
        parse_types(self.shared_types)
        names = [t.value for t in MatrixType]
        for name, value in self.ranks.items():
            if name not in names:
                raise ValueError(f"ranks: unknown matrix type {name!r}; expected some of "
                                 f"{names}")
            ok = (isinstance(value, int) and value >= 1) or (
                isinstance(value, list | tuple) and len(value) == 2
                and all(isinstance(v, int) and v >= 1 for v in value))
            if not ok:
                raise ValueError(f"ranks[{name!r}] must be a positive int or [k_out, k_in], "
                                 f"got {value!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CompressionConfig:
        return dataclass_from_dict(cls, raw)


@dataclass
class TypePlan:
    """How one matrix type is compressed: the effective method (``svd`` for Basis
    Sharing's private types), its ranks (``None`` for ``shared``/``hybrid`` under a
    budget: solved from the data), the budget, groups and parts."""

    type: MatrixType
    method: str
    shape: tuple[int, int]
    ranks: TypeRanks | None
    budget: float | None
    groups: list[list[int]]
    parts: int


def plan_types(adapter: ModelAdapter, cfg: CompressionConfig) -> list[TypePlan]:
    """The effective method, ranks or budget, groups and parts of every compressed type
    (shapes and config only; the ``shared`` ranks under a budget come from the data)."""
    L = adapter.num_layers
    shared_set = set(parse_types(cfg.shared_types))
    plans = []
    for t in parse_types(cfg.types):
        out, inn = tuple(adapter.layers[0].weight(t).shape)
        method = cfg.method
        groups = [[i] for i in range(L)]
        if method in BASIS_SHARING:
            if t in shared_set:
                method = "basis-sharing"
                size = L if cfg.method == "onesided-all-layers" else cfg.group_size
                groups = consecutive_groups(L, size)
            else:
                method = "svd"
        elif method in ("shared", "hybrid"):
            groups = [list(range(L))]
        parts = adapter.row_blocks(t) if method in ("svd", "basis-sharing") else 1
        sizes = [len(g) for g in groups]
        r = cfg.residual_rank if method == "hybrid" else 0
        op = out // parts
        ranks: TypeRanks | None = None
        budget = None
        if t.value in cfg.ranks:
            v = cfg.ranks[t.value]
            ranks = TypeRanks(*v, r) if isinstance(v, list | tuple) else TypeRanks(v, v, r)
        elif cfg.target_reduction is None:
            k = round(cfg.k_fraction * adapter.hidden_size)
            if method in ("shared", "hybrid"):
                ranks = TypeRanks(min(k, out), min(k, inn), r)
            elif method == "svd":
                ranks = TypeRanks(min(k, op, inn), min(k, op, inn))
            else:
                top = max(min(inn, n * op) for n in sizes)
                ranks = TypeRanks(min(k, top), min(k, top))
        else:
            budget = (1 - cfg.target_reduction) * L * out * inn
            if method == "svd":
                k = solve_svd_rank(L, out, inn, budget, parts)
                ranks = TypeRanks(k, k)
            elif method == "basis-sharing":
                k = solve_basis_sharing_rank(out, inn, sizes, parts, budget)
                ranks = TypeRanks(k, k)
        plans.append(TypePlan(t, method, (out, inn), ranks, budget, groups, parts))
    return plans


def factorize_plan(plan: TypePlan, weights: list[torch.Tensor], Cs: list[torch.Tensor],
                   cfg: CompressionConfig, roots: RootCache | None = None) -> TypeFactors:
    """The factors of one type under its plan (``roots``: whitening roots shared across
    the types that read one site)."""
    roots = roots or RootCache(cfg.eig_floor)
    if plan.method == "svd":
        assert plan.ranks is not None
        return factorize_svd(weights, Cs, plan.ranks.k, plan.parts, cfg.eig_floor, roots)
    if plan.method == "basis-sharing":
        assert plan.ranks is not None
        return factorize_basis_sharing(weights, Cs, plan.ranks.k, plan.groups, plan.parts,
                                       cfg.eig_floor, roots)
    if plan.ranks is not None:
        return factorize_shared(plan.method, weights, Cs, plan.ranks, None, cfg.eig_floor,
                                roots)
    r = cfg.residual_rank if plan.method == "hybrid" else 0
    return factorize_shared(plan.method, weights, Cs, TypeRanks(0, 0, r), plan.budget,
                            cfg.eig_floor, roots)


def _split_bias(b: torch.Tensor | None, parts: int) -> list[torch.Tensor | None]:
    return [None] * parts if b is None else list(b.chunk(parts))


def build_modules(factors: TypeFactors, biases: list[torch.Tensor | None]) -> list[nn.Module]:
    """One module per layer from ``factors`` (layers of a group share its basis)."""
    parts = factors.parts
    if factors.method == "svd":
        mods: list[nn.Module] = []
        for e, b in zip(factors.per_layer, biases, strict=True):
            pieces = [LowRankLinear(e[f"B{p}"], e[f"C{p}"], bp)
                      for p, bp in enumerate(_split_bias(b, parts))]
            mods.append(pieces[0] if parts == 1 else ConcatProjection(pieces))
        return mods
    if factors.method == "basis-sharing":
        mods = [nn.Identity() for _ in biases]
        for g, basis in zip(factors.groups, factors.bases, strict=True):
            shared = [SharedBasis(basis[f"P{p}"], None) for p in range(parts)]
            for i in g:
                pieces = [OneSidedLinear(shared[p], factors.per_layer[i][f"D{p}"], bp)
                          for p, bp in enumerate(_split_bias(biases[i], parts))]
                mods[i] = pieces[0] if parts == 1 else ConcatProjection(pieces)
        return mods
    basis = SharedBasis(factors.bases[0]["P"], factors.bases[0]["U"])
    return [SharedBasisLinear(basis, e["core"], b,
                              (e["res_b"], e["res_c"]) if "res_b" in e else None)
            for e, b in zip(factors.per_layer, biases, strict=True)]


def compress_model(adapter: ModelAdapter, cal: Calibration, cfg: CompressionConfig,
                   progress: Any = None, calib_tokens: torch.Tensor | None = None
                   ) -> dict[str, Any]:
    """Factorise ``cfg.types`` in every layer and replace the modules in place; returns
    the accounting (original vs stored parameters per type and for the model), ranks
    and per-layer kept energy. ``cfg.update`` needs ``calib_tokens`` (the calibration
    windows, run again through the compressed model)."""
    if cfg.update and calib_tokens is None:
        raise ValueError("update=True needs the calibration tokens (calib_tokens=...)")
    L = adapter.num_layers
    report: dict[str, Any] = {"config": dataclasses.asdict(cfg), "types": {}}
    total_params = sum(p.numel() for p in adapter.model.parameters())
    orig_sum = stored_sum = 0
    originals: dict[MatrixType, list[torch.Tensor]] = {}
    plans = plan_types(adapter, cfg)
    roots = RootCache(cfg.eig_floor)
    for plan in plans:
        t = plan.type
        weights = adapter.weights(t)
        if cfg.update:
            originals[t] = weights
        Cs = [cal.C(i, t) for i in range(L)]
        factors = factorize_plan(plan, weights, Cs, cfg, roots)
        biases = [adapter.layers[i].bias(t) for i in range(L)]
        for layer, mod in zip(adapter.layers, build_modules(factors, biases), strict=True):
            layer.replace(t, mod)
        out, inn = plan.shape
        original = L * out * inn
        sizes = [len(g) for g in factors.groups]
        stored = stored_parameters(factors.method, out, inn, factors.ranks, sizes,
                                   factors.parts)
        orig_sum, stored_sum = orig_sum + original, stored_sum + stored
        report["types"][t.value] = {
            "method": factors.method, "k": factors.ranks.k, "k_out": factors.ranks.k_out,
            "k_in": factors.ranks.k_in, "r": factors.ranks.r, "shape": [out, inn],
            "parts": factors.parts, "group_sizes": [len(g) for g in factors.groups],
            "original_parameters": original, "stored_parameters": stored,
            "token_macs": token_macs(factors.method, out, inn, factors.ranks, sizes,
                                     factors.parts),
            "budget": plan.budget, "ratio": original / stored, "energy_kept": factors.energy,
            "mean_energy_kept": sum(factors.energy) / L, **factors.info}
        if progress is not None:
            progress.update(1)
    if cfg.update:
        report["update"] = _update(adapter, cal, plans, originals, calib_tokens, cfg)
    report.update(original_parameters=orig_sum, stored_parameters=stored_sum,
                  ratio=orig_sum / max(stored_sum, 1), reduction=1 - stored_sum / orig_sum,
                  model_parameters_before=total_params,
                  model_parameters_after=total_params - orig_sum + stored_sum)
    return report


def _update(adapter: ModelAdapter, cal: Calibration, plans: list[TypePlan],
            originals: dict[MatrixType, list[torch.Tensor]], tokens: torch.Tensor | None,
            cfg: CompressionConfig) -> dict[str, Any]:
    """Basis Sharing's update: calibrate the compressed model, refit the coefficients."""
    from structlm.hf.calibration import calibrate
    from structlm.share.compress.basis_sharing import update_coefficients

    assert tokens is not None
    seq_len = int(cal.meta.get("seq_len", 512))
    new = calibrate(adapter, tokens, seq_len=seq_len, progress=False,
                    meta={"purpose": "basis-sharing update"})
    out: dict[str, Any] = {}
    for plan in plans:
        mods = [layer.module(plan.type) for layer in adapter.layers]
        Cs = [new.C(i, plan.type) for i in range(adapter.num_layers)]
        res = update_coefficients(mods, originals[plan.type], Cs, plan.groups, plan.parts,
                                  cfg.eig_floor)
        out[plan.type.value] = {"error_before": sum(res["error_before"]),
                                "error_after": sum(res["error_after"])}
    return out
