"""``convert_`` / ``unconvert_``: change the product rule of a pretrained causal LM in
place, keeping the parameter count (torchao's ``quantize_(model, config, filter_fn)``
shape).

The chosen projections (default: the FFN's) become :class:`TypedAlgebraLinear` s with
weight and bias tensors of the same shapes under the same names: ``init="copy"`` keeps
every value bit for bit, ``init="calibrated"`` refits the values on calibration
activations (:mod:`.calibrate`), ``permute`` reorders hidden units or heads first
(:mod:`.permute`, :mod:`.heads`; the dense function is unchanged by it); they read their position
types from the model's own position ids (see :mod:`.typed_linear`). Nothing of the
Hugging Face modelling code is edited: the model family's adapter
(:mod:`structlm.hf.adapters`) names the modules and the position source. The
conversion is recorded in ``model.config.structlm_conversion`` so a saved model can be
restored with :func:`load_converted`.

Every target is checked before anything changes: unknown matrix types, a ``filter_fn``
that selects nothing, widths the algebra's ``q`` does not divide, a module that is not a
plain projection (already converted or compressed), a non-associative algebra.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from structlm.algebra import Algebra, AlgebraError, get_algebra, support_of
from structlm.config import ConfigError
from structlm.convert.typed_linear import PositionTypes, TypedAlgebraLinear, dense_from
from structlm.hf.adapters import LinearSite, MatrixType, get_adapter, parse_types
from structlm.nn.schedules import TypeSchedule, get_schedule
from structlm.nn.structure import invalidate_fast_paths

__all__ = ["AlgebraConfig", "check_convertible", "conversion_info", "convert_",
           "install_from_pretrained_hook", "load_converted", "restore_conversion", "unconvert_"]

CONFIG_KEY = "structlm_conversion"
INITS = ("copy", "calibrated")
GROUPS = ("equal", "heads")
_ATTN = {MatrixType.Q, MatrixType.K, MatrixType.V, MatrixType.O}
_FFN = {MatrixType.MLP_IN, MatrixType.MLP_OUT}


@dataclass(frozen=True)
class AlgebraConfig:
    """How to convert a model (checked when built)."""

    algebra: str | Algebra = "Q2^2"
    """Product rule: a catalogue name (Q4, Q2^2, ...; ``structlm algebra table``) or an
    :class:`~structlm.algebra.Algebra`; it must be associative with a unit (what a layer
    needs). Only a named algebra can be restored by :func:`load_converted`."""
    schedule: str = "cyclic"
    """Position types: cyclic (p mod q), block:<size>[:<period>], table:..., or
    cross-layer:<one of these>. Cyclic by default: every window of q tokens holds every
    type, whatever the context of a pretrained model."""
    targets: str = "mlp"
    """Matrix types converted: mlp (the FFN projections, the default), attn, all, or a
    list of q,k,v,o,mlp_in,mlp_out (a fused qkv needs q, k and v together, and becomes
    one algebra layer: see :func:`convert_`)."""
    init: str = "copy"
    """``copy``: every weight kept bit for bit (each type then drops the blocks its support
    does not use); ``calibrated``: the blocks refitted so that every type's product
    approximates the dense projection on calibration activations (float64, ridge toward
    the dense weight, layer by layer: :mod:`structlm.convert.calibrate`). The parameter
    count is the same either way; ``calibrated`` changes the values, and
    :func:`convert_` then needs ``calibration`` token ids."""
    ridge: float | None = None
    """With ``init="calibrated"``: the relative ridge ``lambda = ridge * trace(G) / K``;
    ``None`` chooses it per module from ``calibrate.RIDGES`` by the error on every 8th
    calibration window, held out (then refits on all)."""
    permute: bool = False
    """Before converting, reorder every FFN's hidden units (with FFN targets) and every
    layer's attention heads (with q, k, v and o targets; ``groups="heads"``), a
    function-preserving permutation, so that each type keeps as much of the calibration
    output as possible (:mod:`structlm.convert.permute`, :mod:`structlm.convert.heads`;
    needs ``calibration`` ids)."""
    groups: str = "equal"
    """``equal``: every projection split into ``q`` equal groups; ``heads``: the head side
    of the attention projections (Q/K/V outputs, O inputs) in groups of whole heads
    where there are at least ``q`` heads (:mod:`structlm.convert.heads`; separate
    q/k/v/o projections and attention targets)."""

    def __post_init__(self) -> None:
        try:
            support = support_of(self.algebra_object())
        except AlgebraError as e:  # keep its message, name the field
            raise ConfigError(f"algebra {self.algebra_name!r}: {e}") from None
        if support.q < 2:
            raise ConfigError(f"algebra {self.algebra_name!r} has one type: converting to "
                              "it changes nothing (use Q2, Q4, Q2^2, ...)")
        get_schedule(self.schedule, support.q)  # raises a ValueError naming the spec
        parse_types(self.targets)
        types = set(parse_types(self.targets))
        if self.groups not in GROUPS:
            raise ConfigError(f"groups: {self.groups!r} is not valid: expected one of "
                              f"{GROUPS}")
        if self.groups == "heads" and not types & _ATTN:
            raise ConfigError(f"groups: 'heads' aligns the attention projections' groups to "
                              f"heads, but targets {self.targets!r} hold none of q, k, v, o")
        if self.permute and not (_FFN <= types or _ATTN <= types):
            raise ConfigError(f"permute: reorders FFN hidden units or attention heads, so "
                              f"targets must hold mlp_in and mlp_out (mlp) or q, k, v and o "
                              f"(attn), got {self.targets!r}")
        if self.permute and _ATTN <= types and self.groups != "heads":
            raise ConfigError(f"permute with attention targets ({self.targets!r}) moves "
                              "whole heads between groups: set groups='heads'")
        if self.init not in INITS:
            raise ConfigError(f"init: {self.init!r} is not valid: expected one of {INITS}")
        if self.ridge is not None and not (isinstance(self.ridge, int | float)
                                           and math.isfinite(self.ridge) and self.ridge > 0):
            raise ConfigError(f"ridge: {self.ridge!r} is out of range: expected > 0, or "
                              "None (chosen on held-out calibration windows)")

    def algebra_object(self) -> Algebra:
        return self.algebra if isinstance(self.algebra, Algebra) else get_algebra(self.algebra)

    @property
    def algebra_name(self) -> str:
        return self.algebra.name if isinstance(self.algebra, Algebra) else self.algebra

    @property
    def q(self) -> int:
        return support_of(self.algebra_object()).q

    def record(self) -> dict[str, Any]:
        """The JSON-able description saved in the model's config (a custom
        :class:`Algebra` is marked: only a catalogue name can be rebuilt)."""
        return {"algebra": self.algebra_name, "schedule": self.schedule,
                "targets": self.targets, "custom_algebra": isinstance(self.algebra, Algebra),
                "init": self.init, **({"ridge": self.ridge} if self.init != "copy" else {}),
                **({"permute": True} if self.permute else {}),
                **({"groups": self.groups} if self.groups != "equal" else {})}

    def type_schedule(self) -> TypeSchedule:
        return get_schedule(self.schedule, self.q)


@dataclass
class _Conversion:
    """What :func:`convert_` attached to a model (found again by :func:`unconvert_`)."""

    config: AlgebraConfig
    source: PositionTypes
    names: list[str]
    conv1d: bool
    hook: RemovableHandle
    """The position hook's handle (:func:`unconvert_` removes it through it)."""
    calibration: dict[str, Any] | None = None
    """The summary of a calibrated conversion (:func:`~structlm.convert.calibrate.calibrate_`)."""
    permutation: dict[str, Any] | None = None
    """Per layer, the FFN assignment cost before and after the permutation."""
    unit_orders: dict[int, Any] | None = None
    """Per layer, the FFN hidden units' order the permutation chose (new -> old)."""
    head_orders: dict[int, Any] | None = None
    """Per layer, the (query, K/V) head orders the permutation chose (new -> old)."""


class _PositionHook:
    """The forward pre-hook on the position source: hands the model's position ids to
    the converted layers. An object, not a closure, so that ``copy.deepcopy`` of the model
    copies it along with the source it feeds (a copied model then feeds its own layers)
    and the model pickles."""

    def __init__(self, source: PositionTypes, keyword: str | None, index: int) -> None:
        self.source, self.keyword, self.index = source, keyword, index

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        pos = kwargs.get(self.keyword) if self.keyword else None
        if pos is None and len(args) > self.index:
            pos = args[self.index]
        if pos is None:
            raise RuntimeError(f"{type(module).__name__} was called without position ids: "
                               "the converted layers cannot know their types")
        self.source.set_positions(pos)


def conversion_info(model: nn.Module) -> dict[str, Any] | None:
    """The recorded conversion of ``model`` (algebra, schedule, targets, init, module
    names; after a calibrated conversion in this process, its summary), or ``None`` if it
    is not converted."""
    conv = getattr(model, "_structlm_conversion", None)
    if conv is None:
        return None
    info = {**conv.config.record(), "modules": list(conv.names),
            "parameters": _parameter_note(conv.config)}
    if conv.calibration is not None:
        info["calibration"] = conv.calibration
    if conv.permutation is not None:
        info["permutation"] = conv.permutation
    return info


def _parameter_note(cfg: AlgebraConfig) -> dict[str, str]:
    """What the conversion did to the converted modules' parameters: their count never
    changes; their values are copied, permuted or refitted."""
    if cfg.init == "calibrated":
        values = ("refitted: each output block's weights fitted so every position type's "
                  "product approximates the dense projection on calibration activations")
    elif cfg.permute:
        values = ("copied, reordered: hidden units / heads permuted consistently (the dense "
                  "function is unchanged), every value kept")
    else:
        values = "copied bit for bit"
    return {"count": "unchanged (the same tensor shapes under the same names)",
            "values": values}


def _selected(model: nn.Module, cfg: AlgebraConfig,
              filter_fn: Callable[[nn.Module, str], bool] | None) -> list[tuple[LinearSite, str]]:
    """The sites to convert with their fully qualified names; every problem listed in one
    error before anything changes."""
    adapter = get_adapter(model)
    wanted = set(parse_types(cfg.targets))
    names = {id(m): n for n, m in model.named_modules()}
    q, problems, chosen = cfg.q, [], []
    for layer in adapter.layers:
        for site in layer.linear_sites():
            hit = wanted & set(site.types)
            if not hit:
                continue
            fqn = names[id(site.module)]
            if filter_fn is not None and not filter_fn(site.module, fqn):
                continue
            if cfg.groups == "heads" and len(site.types) > 1 and set(site.types) & _ATTN:
                problems.append(f"{fqn} computes {'/'.join(t.value for t in site.types)} in "
                                "one matrix: head-aligned groups (groups='heads') need "
                                "separate q/k/v/o projections")
                continue
            if hit != set(site.types):
                problems.append(f"{fqn} computes {'/'.join(t.value for t in site.types)} in "
                                f"one matrix: convert them together (targets "
                                f"{','.join(t.value for t in site.types)} or attn)")
                continue
            module = site.module
            kind = type(module).__name__
            if isinstance(module, TypedAlgebraLinear):
                problems.append(f"{fqn} is already converted")
            elif not (isinstance(module, nn.Linear) or kind == "Conv1D"):
                problems.append(f"{fqn} is a {kind}, not a plain projection (nn.Linear or "
                                "Conv1D)")
            else:
                n_in, n_out = _shape(module, adapter.conv1d_layout)
                bad = [f"{w}={v}" for w, v in (("in", n_in), ("out", n_out)) if v % q]
                if bad:
                    problems.append(f"{fqn} ({n_out}x{n_in}): {', '.join(bad)} not divisible "
                                    f"by q={q} of {cfg.algebra_name}")
                else:
                    chosen.append((site, fqn))
    if problems:
        raise ValueError("cannot convert: " + "; ".join(problems))
    if not chosen:
        raise ValueError(f"no module matches targets={cfg.targets!r}"
                         + (" and filter_fn" if filter_fn is not None else ""))
    return chosen


def check_convertible(model: nn.Module, config: AlgebraConfig | None = None,
                      filter_fn: Callable[[nn.Module, str], bool] | None = None) -> list[str]:
    """The names of the modules :func:`convert_` would replace, changing nothing; reads
    shapes only, so an architecture without weights (``load_model(spec, weights=False)``)
    checks a plan before any work.

    Raises:
        ValueError: what :func:`convert_` would raise (every problem named).
    """
    return [fqn for _, fqn in _selected(model, config or AlgebraConfig(), filter_fn)]


def _shape(module: nn.Module, conv1d: bool) -> tuple[int, int]:
    """``(in, out)`` of a projection."""
    if conv1d and type(module).__name__ == "Conv1D":
        n_in, n_out = module.weight.shape
        return int(n_in), int(n_out)
    return int(module.in_features), int(module.out_features)


def convert_(model: nn.Module, config: AlgebraConfig | None = None,
             filter_fn: Callable[[nn.Module, str], bool] | None = None,
             calibration: Any = None, progress: bool = True) -> nn.Module:
    """Replace, in place, the chosen projections of ``model`` (a Hugging Face causal LM of
    a family with an adapter: LLaMA incl. SmolLM2, Mistral, Qwen2/3, Gemma 2/3 (also the
    text decoder of the multimodal Gemma 3), OLMo 2, Phi-3, GPT-2, StructLM) by
    :class:`TypedAlgebraLinear` s with parameters of the same shapes and names (the count
    never changes; ``init="copy"`` keeps the values, ``"calibrated"`` refits them,
    ``permute`` reorders them); returns ``model``.

    A fused projection (GPT-2's ``c_attn``, StructLM's ``qkv``, Phi-3's ``qkv_proj`` and
    ``gate_up_proj``) becomes *one* algebra layer, whose type groups cut across the
    Q/K/V (or gate/up) boundaries, while families with separate modules get one algebra
    layer per matrix: the stored tensors keep their shapes either way, but "attn"
    or "mlp" is not the same construction in every family.

    ``filter_fn(module, fully_qualified_name)`` narrows the targets further (as in
    torchao's ``quantize_``). Position types follow the model's own position ids in every
    forward (cached decode, chunked prefill, left-padded ``generate()`` batches).

    With ``config.init == "calibrated"``, ``calibration`` (token ids ``(n, T)`` or an
    iterable of batches: tensors, ``(ids, ...)`` tuples or mappings with ``input_ids``
    such as a ``DataLoader``'s dicts or a tokenizer's ``BatchEncoding``) drives a
    layer-by-layer refit of the converted blocks (:mod:`structlm.convert.calibrate`; a
    progress bar unless ``progress=False``); its summary (relative calibration error of
    the copy and of the fit, per module and type) is in :func:`conversion_info`.

    Raises:
        ValueError: for any target that cannot be converted (all named, nothing changed);
            ``init="calibrated"`` without calibration ids, or ids with ``init="copy"``.
    """
    cfg = config or AlgebraConfig()
    wants = cfg.init == "calibrated" or cfg.permute
    if wants != (calibration is not None):
        raise ValueError(f"init={cfg.init!r}, permute={cfg.permute} " + (
            "needs calibration token ids (convert_(..., calibration=ids))"
            if calibration is None else "keeps every weight: calibration ids are only used "
            "with init='calibrated' or permute=True"))
    permutation = None
    if cfg.permute:
        if getattr(model, "_structlm_conversion", None) is not None:
            raise ValueError("the model is already converted; unconvert_ it first")
        check_convertible(model, cfg, filter_fn)  # nothing changes if the targets are bad
        from structlm.convert.heads import permute_heads_
        from structlm.convert.permute import permute_ffn_

        types = set(parse_types(cfg.targets))
        orders: dict[int, Any] = {}
        heads: dict[int, Any] = {}
        permutation = {}
        if _FFN <= types:
            permutation.update(permute_ffn_(model, cfg.algebra_object(), cfg.type_schedule(),
                                            calibration, progress, orders))
        if _ATTN <= types:
            permutation.update(permute_heads_(model, cfg.algebra_object(),
                                              cfg.type_schedule(), calibration, progress,
                                              heads))
    _convert(model, cfg, filter_fn)
    conv = model._structlm_conversion
    conv.permutation = permutation
    if cfg.permute:
        conv.unit_orders = orders
        conv.head_orders = heads
    if cfg.init == "calibrated":  # (permute alone reorders; the copied weights stay)
        from structlm.convert.calibrate import calibrate_

        conv.calibration = calibrate_(model, conv.names, calibration, cfg.ridge, progress)
        mods = conv.calibration["modules"].values()
        model.config.__dict__[CONFIG_KEY]["calibration"] = {
            "tokens": conv.calibration["tokens"], "ridge": cfg.ridge,
            "mean_relative_error": {k: sum(m[k] for m in mods) / len(mods)
                                    for k in ("copy", "calibrated")},
            "held_out_mean_relative_error": {
                k: sum(m["held_out"][k] for m in mods) / len(mods)
                for k in ("copy", "calibrated")} if all("held_out" in m for m in mods)
            else None}
    return model


def _convert(model: nn.Module, cfg: AlgebraConfig,
             filter_fn: Callable[[nn.Module, str], bool] | None) -> nn.Module:
    """:func:`convert_` without the calibration: the modules replaced, weights copied."""
    if getattr(model, "_structlm_conversion", None) is not None:
        raise ValueError(f"the model is already converted ({conversion_info(model)}); "
                         "unconvert_ it first")
    adapter = get_adapter(model)
    chosen = _selected(model, cfg, filter_fn)
    src = adapter.position_source()
    source = PositionTypes(cfg.type_schedule())

    algebra = cfg.algebra_object()
    shape = None
    if cfg.groups == "heads":
        from structlm.convert.heads import attention_shape, site_widths

        shape = attention_shape(model)
    for site, _ in chosen:
        module = site.module
        conv1d = adapter.conv1d_layout and type(module).__name__ == "Conv1D"
        n_in, n_out = _shape(module, conv1d)
        widths = None if shape is None else site_widths(site.types, n_in, n_out, shape, cfg.q)
        new = TypedAlgebraLinear(n_in, n_out, algebra, bias=module.bias is not None,
                                 group_sizes=widths,
                                 device=module.weight.device, dtype=module.weight.dtype,
                                 source=source, layer_index=site.layer, conv1d_layout=conv1d)
        new.weight.data.copy_(module.weight.t() if conv1d else module.weight)
        if module.bias is not None:
            new.bias.data.copy_(module.bias)
        new.train(module.training)
        setattr(site.parent, site.attr, new)
    hook = src.module.register_forward_pre_hook(
        _PositionHook(source, src.keyword, src.index), with_kwargs=True)
    names = [fqn for _, fqn in chosen]
    model._structlm_conversion = _Conversion(cfg, source, names, adapter.conv1d_layout, hook)
    model.config.__dict__[CONFIG_KEY] = {**cfg.record(), "modules": names}
    invalidate_fast_paths(model)
    return model


def unconvert_(model: nn.Module) -> nn.Module:
    """Undo :func:`convert_`: every converted projection back to the dense module with the
    same parameters, the hook removed, the record deleted; returns ``model``."""
    conv = getattr(model, "_structlm_conversion", None)
    if conv is None:
        raise ValueError("the model is not converted (no convert_ record)")
    conv1d_cls = None
    if conv.conv1d:
        from transformers.pytorch_utils import Conv1D

        conv1d_cls = Conv1D
    for fqn in conv.names:
        parent_name, _, attr = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = getattr(parent, attr)
        setattr(parent, attr, dense_from(layer, conv1d_cls if layer.conv1d_layout else None))
    conv.hook.remove()
    del model._structlm_conversion
    model.config.__dict__.pop(CONFIG_KEY, None)
    invalidate_fast_paths(model)
    return model


def restore_conversion(model: nn.Module) -> nn.Module:
    """Convert ``model`` again as its config records (``save_pretrained`` of a converted
    model writes the record into ``config.json``); a model without a record is returned
    as it is. Called on every ``from_pretrained`` once structlm is imported, so a saved
    converted model never silently loads as the dense model it came from.

    A record of a custom :class:`Algebra` cannot be rebuilt from its name: the model is
    returned dense with a :class:`UserWarning` saying how to convert it.

    Raises:
        ValueError: the record names modules the model does not have.
    """
    record = getattr(model.config, CONFIG_KEY, None)
    if not isinstance(record, dict) or getattr(model, "_structlm_conversion", None) is not None:
        return model
    if record.get("custom_algebra"):
        warnings.warn(f"this model was saved after structlm.convert_ with a custom algebra "
                      f"{record['algebra']!r}, which cannot be rebuilt from its name: it "
                      "loaded as the DENSE model (a different function); convert_ it with "
                      "the same Algebra object", UserWarning, stacklevel=3)
        return model
    modules = set(record.get("modules") or [])
    cfg = AlgebraConfig(**{k: record[k] for k in ("algebra", "schedule", "targets", "init",
                                                  "ridge", "permute", "groups")
                                 if k in record})
    model.config.__dict__.pop(CONFIG_KEY, None)
    _convert(model, cfg, filter_fn=lambda _m, name: name in modules)  # the saved weights
    if "calibration" in record:
        model.config.__dict__[CONFIG_KEY]["calibration"] = record["calibration"]
    if set(model._structlm_conversion.names) != modules:
        raise ValueError(f"the recorded converted modules {sorted(modules)} are not what the "
                         f"model offers ({sorted(model._structlm_conversion.names)})")
    return model


def install_from_pretrained_hook() -> None:
    """Make ``PreTrainedModel.from_pretrained`` (and so ``AutoModelForCausalLM``'s) end
    with :func:`restore_conversion` (idempotent; ``import structlm`` installs it)."""
    from transformers import PreTrainedModel

    current = PreTrainedModel.__dict__["from_pretrained"]
    if getattr(current.__func__, "_structlm_restores", False):
        return
    original = current.__func__

    @functools.wraps(original)
    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(cls, *args, **kwargs)
        if isinstance(out, tuple):  # output_loading_info=True: (model, info)
            return (restore_conversion(out[0]), *out[1:])
        return restore_conversion(out)

    from_pretrained._structlm_restores = True  # type: ignore[attr-defined]
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)  # type: ignore[assignment]


def load_converted(path: str, **from_pretrained_kwargs: Any) -> nn.Module:
    """A model saved after :func:`convert_` (``save_pretrained``), converted again as it
    was recorded: the same modules, algebra and schedule (the weights are the saved
    ones: conversion keeps parameter names and shapes). Plain ``from_pretrained`` does the
    same once structlm is imported; this one also refuses a folder without a record.

    Raises:
        ValueError: no conversion record, or one of a custom algebra.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    import structlm.models  # noqa: F401  (registers model_type "structlm")

    record = getattr(AutoConfig.from_pretrained(path), CONFIG_KEY, None)
    if not isinstance(record, dict):
        raise ValueError(f"{path}: config.json has no {CONFIG_KEY!r} record: not a model "
                         "saved after structlm.convert_")
    if record.get("custom_algebra"):
        raise ValueError(f"{path}: converted with a custom algebra {record['algebra']!r}, "
                         "which cannot be rebuilt from its name: load the folder as a dense "
                         "model and convert_ it with the same Algebra object")
    install_from_pretrained_hook()
    model = AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs)
    if conversion_info(model) is None:  # pragma: no cover - the hook always restores
        raise ValueError(f"{path}: the conversion was not restored")
    return model
