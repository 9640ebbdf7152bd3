"""Compress a model in place: factorise the chosen matrix types and swap the modules
through the adapter; honest parameter accounting."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch
from torch import nn
from tqdm import tqdm

from structlm.config import ConfigError, NonEmpty, OneOf, Range, dataclass_from_dict, validated
from structlm.hf.adapters import MatrixType, ModelAdapter, parse_types
from structlm.hf.calibration import Calibration
from structlm.hf.transaction import restore_on_error
from structlm.settings import cache_dir
from structlm.share.compress.factorize import RootCache, TypeFactors, TypeRanks
from structlm.share.compress.methods import (
    BASIS_SHARING_METHOD,
    METHODS,
    SHARED_METHOD,
    BasisSharingOptions,
    HybridOptions,
    TypePlan,
    canonical_name,
    get_method,
)
from structlm.share.compress.methods.basis_sharing import DEFAULT_GROUP_SIZE

__all__ = ["CompressionConfig", "TypePlan", "build_modules", "compress_model", "finish_report",
           "plan_types", "type_entry"]


@dataclass
@validated
class CompressionConfig:
    """One compression (a YAML file or CLI flags fill it)."""

    method: Annotated[str, NonEmpty()] = SHARED_METHOD.name
    """A registered method (:data:`~structlm.share.compress.methods.METHODS`): ``shared``
    | ``hybrid`` | ``svd-llm-w`` | ``svd-llm`` | ``basis-sharing`` | ``onesided-all-layers``
    built in (see :mod:`.ranks`); the former ``svd`` is read as ``svd-llm-w`` with a
    ``DeprecationWarning``."""
    types: Annotated[str, NonEmpty()] = "attn"
    """Matrix types to compress: ``attn``, ``mlp``, ``all`` or ``q,k,v,o,mlp_in,mlp_out``."""
    k_fraction: Annotated[float, Range(gt=0, le=1)] = 0.25
    """Without ``target_reduction``: rank k = k_fraction × hidden size (the seed's d/4), on
    each side only as far as that side's dimension allows."""
    ranks: dict[str, Any] = field(default_factory=dict)
    """Per-type rank overrides: ``{"q": 96}`` or, for ``shared``/``hybrid``,
    ``{"k": [k_out, k_in]}``."""
    target_reduction: Annotated[float | None, Range(gt=0, lt=1)] = None
    """If set (e.g. 0.2): remove this fraction of every compressed type's parameters
    (per-type budget; ranks solved per method)."""
    eig_floor: Annotated[float, Range(ge=0, lt=1)] = 1e-6
    """Relative eigenvalue floor of the whitening roots (a fraction of the largest)."""
    budget: Annotated[str, OneOf("per_type")] = "per_type"
    """Only ``per_type`` (the Basis Sharing / SVD-LLM convention). The former ``pooled``
    budget existed to pass on what a rank capped at ``min(out, in)`` could not use; no
    rank is capped that way any more."""
    basis_sharing: BasisSharingOptions = field(default_factory=BasisSharingOptions)
    """``basis-sharing`` / ``onesided-all-layers``: group size, shared types, update
    (:class:`~structlm.share.compress.methods.basis_sharing.BasisSharingOptions`)."""
    hybrid: HybridOptions = field(default_factory=HybridOptions)
    """``hybrid``: the residual's rank
    (:class:`~structlm.share.compress.methods.shared.HybridOptions`)."""

    def __post_init__(self) -> None:
        """Cross-field checks (each field's own range is checked by ``@validated``)."""
        self.method = canonical_name(self.method)  # a deprecated alias: its new name
        method = get_method(self.method)  # names an unknown value and the choices
        for key, cls in _OPTIONS.items():  # a mapping given through the API: its dataclass
            value = getattr(self, key)
            if isinstance(value, dict):
                setattr(self, key, dataclass_from_dict(cls, value, where=key))
            elif not isinstance(value, cls):
                raise ConfigError(f"{key}: expected a {cls.__name__} or a mapping of its "
                                  f"keys, got {type(value).__name__}")
        if self.basis_sharing.update and not method.supports_update:
            able = tuple(n for n, m in METHODS.items() if m.supports_update)
            always = (f" ({self.method!r} always runs its own update: leave update off)"
                      if method.always_updates else "")
            raise ConfigError(f"basis_sharing.update is Basis Sharing's step: method must "
                              f"be one of {able}, got {self.method!r}{always}")
        try:
            parse_types(self.types)
        except ValueError as e:
            raise ConfigError(f"types: {e}") from None
        names = [t.value for t in MatrixType]
        for name, value in self.ranks.items():
            if name not in names:
                raise ConfigError(f"ranks: unknown matrix type {name!r}; expected some of "
                                  f"{names}")
            ok = (isinstance(value, int) and not isinstance(value, bool) and value >= 1) or (
                isinstance(value, list | tuple) and len(value) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                        for v in value))
            if not ok:
                raise ConfigError(f"ranks[{name!r}] must be a positive int or [k_out, k_in], "
                                  f"got {value!r}")

    def check_model(self, num_layers: int) -> None:
        """Refuse what a model of ``num_layers`` layers cannot give (before any work): a
        ``group_size`` beyond its layers, where the method groups layers by it (or where it
        was changed from the default: a value set on purpose that cannot apply)."""
        groups_by_size = self.method == BASIS_SHARING_METHOD.name
        size = self.basis_sharing.group_size
        if size > num_layers and (groups_by_size or size != DEFAULT_GROUP_SIZE):
            raise ConfigError(f"group_size: {size} is more than the model's "
                              f"{num_layers} layers (consecutive layers per shared basis)")

    def legacy_dict(self) -> dict[str, Any]:
        """The fields as the flat config before the per-method options had them
        (``residual_rank``, ``group_size``, ``shared_types``, ``update`` at the top): the
        key of results cached under it (an experiment's arms), which must not change."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in _OPTIONS}
        flat["ranks"] = dict(self.ranks)
        order = ["method", "types", "k_fraction", "ranks", "residual_rank",
                 "target_reduction", "eig_floor", "budget", "group_size", "shared_types",
                 "update"]
        flat.update(residual_rank=self.hybrid.residual_rank, **dataclasses.asdict(
            self.basis_sharing))
        return {k: flat[k] for k in order}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "", warn: bool = True
                  ) -> CompressionConfig:
        """From a YAML mapping, CLI flags or a saved report; the flat keys of before
        (``group_size``, ``shared_types``, ``update``, ``residual_rank``) are read into
        their method's options, with a :class:`FutureWarning` (shown to CLI users too)
        unless ``warn`` is off (a folder saved before, read as it was written)."""
        raw = dict(raw)
        moved = {k: raw.pop(k) for k in list(raw) if k in _LEGACY_KEYS}
        if moved and warn:
            warnings.warn(f"{where + ': ' if where else ''}CompressionConfig keys "
                          f"{sorted(moved)} are per-method options now: write them under "
                          + ", ".join(sorted({f"{_LEGACY_KEYS[k]}: {{{k}: ...}}"
                                              for k in moved})),
                          FutureWarning, stacklevel=2)
        if moved:
            for k, v in moved.items():
                section = raw.get(_LEGACY_KEYS[k]) or {}
                if not isinstance(section, dict):
                    raise ConfigError(f"{_LEGACY_KEYS[k]}: expected a mapping, got "
                                      f"{type(section).__name__}")
                if k in section and section[k] != v:
                    raise ConfigError(f"{k} given twice: {v!r} at the top and "
                                      f"{section[k]!r} under {_LEGACY_KEYS[k]}")
                raw[_LEGACY_KEYS[k]] = {**section, k: v}
        return dataclass_from_dict(cls, raw, nested=dict(_OPTIONS), where=where)


_OPTIONS: dict[str, type] = {"basis_sharing": BasisSharingOptions, "hybrid": HybridOptions}
"""The per-method option fields of :class:`CompressionConfig` and their dataclasses."""
_LEGACY_KEYS = {"group_size": "basis_sharing", "shared_types": "basis_sharing",
                "update": "basis_sharing", "residual_rank": "hybrid"}
"""The flat keys of before, and the options field each belongs to now."""


def plan_types(adapter: ModelAdapter, cfg: CompressionConfig) -> list[TypePlan]:
    """The effective method, ranks or budget, groups and parts of every compressed type
    (shapes and config only; ranks a method chooses from the data, as ``shared`` does
    under a budget, stay ``None``)."""
    L = adapter.num_layers
    configured = get_method(cfg.method)
    plans = []
    for t in parse_types(cfg.types):
        out, inn = tuple(adapter.layers[0].weight(t).shape)
        method, groups = configured.layout(t, L, cfg)
        parts = adapter.row_blocks(t) if method.splits_row_blocks else 1
        sizes = [len(g) for g in groups]
        r = cfg.hybrid.residual_rank if method.has_residual else 0
        ranks: TypeRanks | None = None
        budget = None
        if t.value in cfg.ranks:
            v = cfg.ranks[t.value]
            ranks = TypeRanks(*v, r) if isinstance(v, list | tuple) else TypeRanks(v, v, r)
        elif cfg.target_reduction is None:
            k = round(cfg.k_fraction * adapter.hidden_size)
            ranks = method.default_ranks(k, (out, inn), sizes, parts, r)
        else:
            budget = (1 - cfg.target_reduction) * L * out * inn
            ranks = method.budget_ranks((out, inn), sizes, parts, budget, r)
        plans.append(TypePlan(t, method.name, (out, inn), ranks, budget, groups, parts, r))
    return plans


def factorize_plan(plan: TypePlan, weights: list[torch.Tensor], Cs: Sequence[torch.Tensor],
                   cfg: CompressionConfig, roots: RootCache | None = None) -> TypeFactors:
    """The factors of one type under its plan (``roots``: whitening roots shared across
    the types that read one site)."""
    return get_method(plan.method).factorize(plan, weights, Cs, cfg.eig_floor,
                                             roots or RootCache(cfg.eig_floor))


def build_modules(factors: TypeFactors, biases: list[torch.Tensor | None]) -> list[nn.Module]:
    """One module per layer from ``factors`` (layers of a group share its basis)."""
    return get_method(factors.method).build_modules(factors, biases)


def compress_model(adapter: ModelAdapter, cal: Calibration, cfg: CompressionConfig,
                   progress: bool = False, calib_tokens: torch.Tensor | None = None
                   ) -> dict[str, Any]:
    """Factorise ``cfg.types`` in every layer and replace the modules in place; returns
    the accounting (original vs stored parameters per type and for the model), ranks
    and per-layer kept energy (``progress``: a bar over the types).

    An update step runs after every type is replaced: Basis Sharing's optional one with
    ``cfg.basis_sharing.update``, or the method's own where it always updates (``svd-llm``); its
    report per type is ``report["update"]`` and its time ``report["update_seconds"]``. It
    needs ``calib_tokens`` (the calibration windows, run again through the compressed
    model), checked before any work. Every input is checked before the first module is
    replaced, and an error part-way puts every replaced module back (the model is left
    exactly as it was)."""
    configured = get_method(cfg.method)
    runs_update = configured.runs_update(cfg.basis_sharing.update)
    if runs_update and calib_tokens is None:
        why = (f"method {configured.name!r} refits every layer on the calibration windows "
               "(its update is part of the method)" if configured.always_updates
               else "update=True")
        raise ValueError(f"{why}: it needs the calibration tokens (calib_tokens=...)")
    if runs_update:
        _check_tokens(adapter, calib_tokens)
    L = adapter.num_layers
    plans = plan_types(adapter, cfg)
    for plan in plans:  # every moment the factorisations read exists: checked first
        cal.layer_moments(plan.type, list(range(L)))
    with restore_on_error(adapter.model):  # an error part-way leaves the model as it was
        return _compress(adapter, cal, cfg, plans, progress, calib_tokens, runs_update)


def _check_tokens(adapter: ModelAdapter, tokens: Any) -> None:
    """Calibration windows ``(n, seq)`` (within the model's context) or one stream
    ``(seq,)`` of integer ids in the vocabulary.

    Raises:
        ValueError: naming what is wrong.
    """
    from structlm.hf.loading import model_context

    if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or \
            tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"calib_tokens must be integer token ids (a LongTensor (n, seq)), "
                         f"not {type(tokens).__name__}"
                         + (f" of {tokens.dtype}" if isinstance(tokens, torch.Tensor) else ""))
    if tokens.dim() not in (1, 2) or tokens.numel() == 0:
        raise ValueError(f"calib_tokens must be windows (n, seq) or one stream (seq,) of "
                         f"ids, got shape {tuple(tokens.shape)}")
    vocab = int(adapter.model.get_input_embeddings().weight.shape[0])
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"calib_tokens hold ids in [{lo}, {hi}], outside the model's "
                         f"vocabulary [0, {vocab})")
    context = model_context(adapter.model)
    if context is not None and tokens.dim() == 2 and tokens.shape[1] > context:
        raise ValueError(f"calib_tokens windows of {tokens.shape[1]} tokens are longer than "
                         f"the model's context ({context} positions)")


def _compress(adapter: ModelAdapter, cal: Calibration, cfg: CompressionConfig,
              plans: list[TypePlan], progress: bool, calib_tokens: torch.Tensor | None,
              runs_update: bool) -> dict[str, Any]:
    """:func:`compress_model` after its checks."""
    configured = get_method(cfg.method)
    L = adapter.num_layers
    report: dict[str, Any] = {"config": dataclasses.asdict(cfg), "types": {}}
    total_params = sum(p.numel() for p in adapter.model.parameters())
    orig_sum = stored_sum = 0
    originals: dict[MatrixType, list[torch.Tensor]] = {}
    roots = RootCache(cfg.eig_floor, store=cache_dir("roots"))  # keyed on content
    bar = tqdm(plans, desc="compress", unit="type", disable=not progress, leave=False)
    for plan in bar:
        t = plan.type
        bar.set_postfix_str(t.value)
        weights = adapter.weights(t)
        if runs_update:
            originals[t] = weights
        Cs = cal.layer_moments(t, list(range(L)))  # each read when used
        factors = factorize_plan(plan, weights, Cs, cfg, roots)
        biases = [adapter.layers[i].bias(t) for i in range(L)]
        for layer, mod in zip(adapter.layers, build_modules(factors, biases), strict=True):
            layer.replace(t, mod)
        entry = type_entry(factors.method, factors.ranks, plan.shape, factors.parts,
                           [len(g) for g in factors.groups], plan.budget, factors.energy,
                           factors.info)
        orig_sum += entry["original_parameters"]
        stored_sum += entry["stored_parameters"]
        report["types"][t.value] = entry
    if runs_update:
        assert calib_tokens is not None
        t0 = time.perf_counter()
        report["update"] = configured.update(adapter, cal, plans, originals, calib_tokens,
                                             cfg.eig_floor)
        report["update_seconds"] = time.perf_counter() - t0
    return finish_report(report, orig_sum, stored_sum, total_params)


def type_entry(method_name: str, ranks: TypeRanks, shape: tuple[int, int], parts: int,
               group_sizes: list[int], budget: float | None, energy: list[float],
               info: dict[str, Any]) -> dict[str, Any]:
    """The report of one compressed type over all its layers (``energy``: kept energy
    per layer, in order)."""
    method = get_method(method_name)
    out, inn = shape
    original = sum(group_sizes) * out * inn
    stored = method.stored_parameters(out, inn, ranks, group_sizes, parts)
    return {"method": method_name, "k": ranks.k, "k_out": ranks.k_out, "k_in": ranks.k_in,
            "r": ranks.r, "shape": [out, inn], "parts": parts, "group_sizes": group_sizes,
            "original_parameters": original, "stored_parameters": stored,
            "token_macs": method.token_macs(out, inn, ranks, group_sizes, parts),
            "budget": budget, "ratio": original / stored, "energy_kept": energy,
            "mean_energy_kept": sum(energy) / len(energy), **info}


def finish_report(report: dict[str, Any], original: int, stored: int, total_params: int
                  ) -> dict[str, Any]:
    """``report`` with the accounting over every compressed type and the whole model."""
    report.update(original_parameters=original, stored_parameters=stored,
                  ratio=original / max(stored, 1), reduction=1 - stored / original,
                  model_parameters_before=total_params,
                  model_parameters_after=total_params - original + stored)
    return report

