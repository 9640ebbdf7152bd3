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
restored (:mod:`.record`: :func:`~structlm.convert.record.load_converted`).

Every target is checked before anything changes: unknown matrix types, a ``filter_fn``
that selects nothing, widths the algebra's ``q`` does not divide, a module that is not a
plain projection (already converted or compressed), a non-associative algebra.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from structlm.algebra import Algebra
from structlm.convert.algebra_config import _ATTN, _FFN, CONFIG_KEY, AlgebraConfig
from structlm.convert.typed_linear import PositionTypes, TypedAlgebraLinear, dense_from
from structlm.hf.adapters import LinearSite, get_adapter, parse_types
from structlm.nn.structure import invalidate_fast_paths

__all__ = ["AlgebraConfig", "check_convertible", "conversion_info", "convert_", "unconvert_"]


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


def _as_config(config: AlgebraConfig | str | Algebra | None) -> AlgebraConfig:
    """``config`` as an :class:`AlgebraConfig` (an algebra name or object: the defaults
    with that product rule)."""
    if config is None:
        return AlgebraConfig()
    if isinstance(config, AlgebraConfig):
        return config
    if isinstance(config, str | Algebra):
        return AlgebraConfig(algebra=config)
    raise TypeError(f"config must be an AlgebraConfig, an algebra name such as 'Q4' or an "
                    f"Algebra, got {type(config).__name__} {config!r}")


def _check_model(model: Any, what: str) -> None:
    """Refuse what is not a Hugging Face causal LM before any attribute is read."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config") \
            or not callable(getattr(model, "get_input_embeddings", None)):
        raise TypeError(f"{what} expects a Hugging Face causal LM (a PreTrainedModel with a "
                        f"config and get_input_embeddings), got {type(model).__name__}")


@dataclass
class _Planned:
    """One projection to replace, checked: its site, name, layout and group widths."""

    site: LinearSite
    fqn: str
    conv1d: bool
    n_in: int
    n_out: int
    widths: tuple[tuple[int, ...], tuple[int, ...]] | None


def _plan(model: nn.Module, cfg: AlgebraConfig,
          filter_fn: Callable[[nn.Module, str], bool] | None) -> list[_Planned]:
    """Every replacement :func:`convert_` makes, each checked (head widths included);
    changes nothing."""
    adapter = get_adapter(model)
    chosen = _selected(model, cfg, filter_fn)
    shape = None
    if cfg.groups == "heads":
        from structlm.convert.heads import attention_shape

        shape = attention_shape(model)
    plan = []
    for site, fqn in chosen:
        conv1d = adapter.conv1d_layout and type(site.module).__name__ == "Conv1D"
        n_in, n_out = _shape(site.module, conv1d)
        widths = None
        if shape is not None:
            from structlm.convert.heads import site_widths

            widths = site_widths(site.types, n_in, n_out, shape, cfg.q)
        plan.append(_Planned(site, fqn, conv1d, n_in, n_out, widths))
    return plan


class _Undo:
    """What a change to a model did so far, to put back exactly if it raises: the
    replaced modules (the originals, untouched), the position hook, the conversion
    record, the permutations applied (undone by their inverses, bit for bit)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.had_record = CONFIG_KEY in model.config.__dict__
        self.record = copy.deepcopy(model.config.__dict__.get(CONFIG_KEY))
        self.training = model.training
        self.swapped: list[tuple[nn.Module, str, nn.Module]] = []
        self.hook: RemovableHandle | None = None
        self.ffn_orders: dict[int, Any] = {}
        self.head_orders: dict[int, Any] = {}

    def rollback(self) -> None:
        """Put the model back as it was when this was created."""
        model = self.model
        for parent, attr, original in reversed(self.swapped):
            setattr(parent, attr, original)
        if self.hook is not None:
            self.hook.remove()
        if "_structlm_conversion" in model.__dict__:
            del model._structlm_conversion
        model.config.__dict__.pop(CONFIG_KEY, None)
        if self.had_record:
            model.config.__dict__[CONFIG_KEY] = self.record
        if self.head_orders:
            from structlm.convert.heads import apply_head_orders_

            apply_head_orders_(model, {i: (o[0].argsort(), o[1].argsort())
                                       for i, o in self.head_orders.items()})
        if self.ffn_orders:
            from structlm.convert.permute import apply_ffn_orders_

            apply_ffn_orders_(model, {i: o.argsort() for i, o in self.ffn_orders.items()})
        model.train(self.training)
        invalidate_fast_paths(model)


@contextmanager
def _atomic(model: nn.Module) -> Iterator[_Undo]:
    """Run a change of ``model``; on any exception (an interrupt too), undo it and
    re-raise."""
    undo = _Undo(model)
    try:
        yield undo
    except BaseException:
        undo.rollback()
        raise


def convert_(model: nn.Module, config: AlgebraConfig | str | Algebra | None = None,
             filter_fn: Callable[[nn.Module, str], bool] | None = None,
             calibration: Any = None, progress: bool = True) -> nn.Module:
    """Replace, in place, the chosen projections of ``model`` (a Hugging Face causal LM of
    a family with an adapter: LLaMA incl. SmolLM2, Mistral, Qwen2/3, Gemma 2/3 (also the
    text decoder of the multimodal Gemma 3), OLMo 2, Phi-3, GPT-2, StructLM) by
    :class:`TypedAlgebraLinear` s with parameters of the same shapes and names (the count
    never changes; ``init="copy"`` keeps the values, ``"calibrated"`` refits them,
    ``permute`` reorders them); returns ``model``.

    ``config`` is an :class:`AlgebraConfig`, or just an algebra name (``"Q4"``) or
    :class:`~structlm.algebra.Algebra`: ``AlgebraConfig(algebra=config)``, every other
    field at its default; ``None``: ``AlgebraConfig()``.

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
    the copy and of the fit, per module and type) is in :func:`conversion_info`. The ids
    are checked first: integers ``(batch, seq)`` (a 1-D tensor is one sequence) in
    ``[0, vocabulary)``, ``seq`` within the model's context.

    Atomic: every input is checked before the first change, and if anything raises
    during the change (a position type the calibration never shows, an interrupt), the
    model is put back exactly as it was (modules, values, record) before it propagates.

    Raises:
        TypeError: ``model`` is not a Hugging Face causal LM, ``config`` not an
            AlgebraConfig / algebra name / Algebra, ``filter_fn`` not callable.
        ValueError: for any target that cannot be converted (all named, nothing changed);
            ``init="calibrated"`` without calibration ids, ids with ``init="copy"``, ids
            that are not integers ``(batch, seq)`` within the vocabulary and context.
    """
    cfg = _as_config(config)
    _check_model(model, "convert_")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be callable (module, name) -> bool or None, got "
                        f"{type(filter_fn).__name__}")
    wants = cfg.init == "calibrated" or cfg.permute
    if wants != (calibration is not None):
        raise ValueError(f"init={cfg.init!r}, permute={cfg.permute} " + (
            "needs calibration token ids (convert_(..., calibration=ids))"
            if calibration is None else "keeps every weight: calibration ids are only used "
            "with init='calibrated' or permute=True"))
    if getattr(model, "_structlm_conversion", None) is not None:
        raise ValueError(f"the model is already converted ({conversion_info(model)}); "
                         "unconvert_ it first")
    plan = _plan(model, cfg, filter_fn)  # every target checked; nothing changed yet
    batches = None
    if calibration is not None:
        from structlm.convert.calibrate import calibration_batches, model_context

        batches = calibration_batches(calibration,
                                      int(model.get_input_embeddings().weight.shape[0]),
                                      context=model_context(model))
    with _atomic(model) as undo:
        permutation = None
        if cfg.permute:
            permutation = _permute(model, cfg, batches, progress, undo)
        _apply(model, cfg, plan, undo)
        conv = model._structlm_conversion
        conv.permutation = permutation
        if cfg.permute:
            conv.unit_orders = undo.ffn_orders
            conv.head_orders = undo.head_orders
        if cfg.init == "calibrated":  # (permute alone reorders; the copied weights stay)
            from structlm.convert.calibrate import calibrate_

            conv.calibration = calibrate_(model, conv.names, batches, cfg.ridge, progress)
            model.config.__dict__[CONFIG_KEY]["calibration"] = _calibration_record(
                conv.calibration, cfg.ridge)
    return model


def _permute(model: nn.Module, cfg: AlgebraConfig, batches: Any, progress: bool,
             undo: _Undo) -> dict[str, Any]:
    """The function-preserving permutations of ``cfg.permute`` (orders kept in ``undo``)."""
    from structlm.convert.heads import permute_heads_
    from structlm.convert.permute import permute_ffn_

    types = set(parse_types(cfg.targets))
    permutation: dict[str, Any] = {}
    if _FFN <= types:
        permutation.update(permute_ffn_(model, cfg.algebra_object(), cfg.type_schedule(),
                                        batches, progress, undo.ffn_orders))
    if _ATTN <= types:
        permutation.update(permute_heads_(model, cfg.algebra_object(), cfg.type_schedule(),
                                          batches, progress, undo.head_orders))
    return permutation


def _calibration_record(summary: dict[str, Any], ridge: float | None) -> dict[str, Any]:
    """The saved summary of a calibrated conversion (mean errors over the modules)."""
    mods = summary["modules"].values()
    return {"tokens": summary["tokens"], "ridge": ridge,
            "mean_relative_error": {k: sum(m[k] for m in mods) / len(mods)
                                    for k in ("copy", "calibrated")},
            "held_out_mean_relative_error": {
                k: sum(m["held_out"][k] for m in mods) / len(mods)
                for k in ("copy", "calibrated")} if all("held_out" in m for m in mods)
            else None}


def _apply(model: nn.Module, cfg: AlgebraConfig, plan: list[_Planned], undo: _Undo) -> None:
    """Replace the planned modules (weights copied), install the position hook, record
    the conversion; every step noted in ``undo``."""
    adapter = get_adapter(model)
    src = adapter.position_source()
    source = PositionTypes(cfg.type_schedule())
    algebra = cfg.algebra_object()
    new = []
    for p in plan:  # every new module built before the first swap
        module = p.site.module
        layer = TypedAlgebraLinear(p.n_in, p.n_out, algebra, bias=module.bias is not None,
                                   group_sizes=p.widths, device=module.weight.device,
                                   dtype=module.weight.dtype, source=source,
                                   layer_index=p.site.layer, conv1d_layout=p.conv1d)
        with torch.no_grad():
            layer.weight.copy_(module.weight.t() if p.conv1d else module.weight)
            if module.bias is not None:
                layer.bias.copy_(module.bias)
        layer.train(module.training)
        new.append(layer)
    for p, layer in zip(plan, new, strict=True):
        undo.swapped.append((p.site.parent, p.site.attr, getattr(p.site.parent, p.site.attr)))
        setattr(p.site.parent, p.site.attr, layer)
    undo.hook = src.module.register_forward_pre_hook(
        _PositionHook(source, src.keyword, src.index), with_kwargs=True)
    names = [p.fqn for p in plan]
    model._structlm_conversion = _Conversion(cfg, source, names, adapter.conv1d_layout,
                                             undo.hook)
    model.config.__dict__[CONFIG_KEY] = {**cfg.record(), "modules": names}
    invalidate_fast_paths(model)


def unconvert_(model: nn.Module) -> nn.Module:
    """Undo :func:`convert_`: every converted projection back to the dense module with the
    same parameters, the hook removed, the record deleted; returns ``model``.

    Atomic: every recorded module is checked and its dense replacement built before the
    first swap; if a swap raises, the converted modules are put back.

    Raises:
        TypeError: ``model`` is not a Hugging Face causal LM.
        ValueError: the model is not converted, or a recorded module is no longer a
            converted layer (replaced by hand); nothing changed.
    """
    _check_model(model, "unconvert_")
    conv = getattr(model, "_structlm_conversion", None)
    if conv is None:
        raise ValueError("the model is not converted (no convert_ record)")
    conv1d_cls = None
    if conv.conv1d:
        from transformers.pytorch_utils import Conv1D

        conv1d_cls = Conv1D
    swaps = []
    for fqn in conv.names:
        parent_name, _, attr = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = getattr(parent, attr, None)
        if not isinstance(layer, TypedAlgebraLinear):
            raise ValueError(f"{fqn} is a {type(layer).__name__}, not the converted layer "
                             "convert_ put there: it was replaced after the conversion, so "
                             "unconvert_ cannot restore the dense model")
        swaps.append((parent, attr, layer,
                      dense_from(layer, conv1d_cls if layer.conv1d_layout else None)))
    done = []
    try:
        for parent, attr, layer, dense in swaps:
            setattr(parent, attr, dense)
            done.append((parent, attr, layer))
    except BaseException:
        for parent, attr, layer in reversed(done):
            setattr(parent, attr, layer)
        raise
    conv.hook.remove()
    del model._structlm_conversion
    model.config.__dict__.pop(CONFIG_KEY, None)
    invalidate_fast_paths(model)
    return model
