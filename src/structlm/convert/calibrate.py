"""Calibrated conversion: refit a converted projection's blocks so that every position
type's product approximates the dense projection on calibration activations.

A converted projection keeps the dense weight ``A`` bit for bit, and each position type
``alpha`` computes with only the blocks its support allows: output group ``delta`` of a
row of type ``alpha`` is ``y_delta = W_delta D_{alpha,delta} x``, where
``D_{alpha,delta}`` is the 0/1 diagonal that keeps the input groups ``beta`` with
``mask[alpha, beta, delta]``. The calibrated weight minimises, per output group, the
squared error to the dense output on calibration inputs summed over types, plus a ridge
that pulls toward the dense weight::

    E(W_delta) = sum_alpha sum_{x of type alpha} |W_delta D x - A_delta x|^2
                 + lambda |W_delta - A_delta|^2

whose closed form, from the float64 second moments ``C_alpha = sum x x^T`` of each
type's inputs, is ``W_delta (G + lambda I) = A_delta (R + lambda I)`` with
``G = sum_alpha D C_alpha D`` and ``R = sum_alpha C_alpha D``. The ridge is relative:
``lambda = ridge * trace(G) / in_features`` (default ``ridge = 1e-4``). Because the
penalty vanishes at ``W = A``, the fit never has a larger calibration error than the
copy; blocks no type uses keep the dense values.

Modules are calibrated **sequentially**, stage by stage in forward order (a layer's
q/k/v, then o, then the FFN's input projections, then its output projection): each
stage's inputs are collected by running the model — already calibrated up to there —
on the calibration batches and stopping as soon as the stage's modules have seen their
input, as the layer-wise compression methods (GPTQ, SVD-LLM) do. Parameter count and
names are unchanged; the values change.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from structlm.convert.typed_linear import TypedAlgebraLinear
from structlm.hf.adapters import MatrixType, get_adapter
from structlm.hf.hooks import StopForward, hooked, run_until_stopped
from structlm.hf.loading import model_context
from structlm.nn.structure import invalidate_fast_paths

__all__ = ["DEFAULT_RIDGE", "block_error", "calibrate_", "calibration_batches", "fit_blocks",
           "model_context", "type_masks"]

DEFAULT_RIDGE = 1e-4
"""Relative ridge: ``lambda = ridge * trace(G) / in_features`` per output group."""

_STAGE = {MatrixType.Q: 0, MatrixType.K: 0, MatrixType.V: 0, MatrixType.O: 1,
          MatrixType.MLP_IN: 2, MatrixType.MLP_OUT: 3}
"""Modules of one stage read the same input; a later stage reads what earlier ones made."""


def type_masks(mask: np.ndarray, in_widths: Sequence[int], delta: int) -> torch.Tensor:
    """``(q, in_features)`` float64: row ``alpha`` is the diagonal of ``D_{alpha,delta}``
    (1 on the input groups type ``alpha`` reads for output group ``delta``)."""
    widths = torch.tensor(list(in_widths))
    cols = torch.as_tensor(np.asarray(mask[:, :, delta], dtype=np.float64))  # (q, q)
    return torch.repeat_interleave(cols, widths, dim=1)  # (q, K)


def _terms(c: torch.Tensor, mask: np.ndarray, in_widths: Sequence[int], delta: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For output group ``delta``: ``G = sum D C D``, ``RT = sum D C`` and ``S = sum C``
    over the types (float64, ``(K, K)`` each)."""
    d = type_masks(mask, in_widths, delta)  # (q, K)
    return (torch.einsum("ai,aij,aj->ij", d, c, d), torch.einsum("ai,aij->ij", d, c),
            c.sum(0))


def _solve_group(a_rows: torch.Tensor, g: torch.Tensor, rhs_t: torch.Tensor, ridge: float
                 ) -> torch.Tensor:
    """``W (G + lam I) = rhs_t^T + lam A`` for one output group, ``lam`` relative to ``G``'s
    mean diagonal (``rhs_t = RT A^T``, ``(K, N_delta)``)."""
    k = g.shape[0]
    lam = ridge * float(torch.diagonal(g).sum()) / k or ridge
    lhs = g + lam * torch.eye(k, dtype=torch.float64)
    rhs = rhs_t + lam * a_rows.T
    try:
        sol = torch.cholesky_solve(rhs, torch.linalg.cholesky(lhs))
    except RuntimeError:  # not numerically positive definite: the general solver
        sol = torch.linalg.lstsq(lhs, rhs).solution
    return sol.T


def _group_error(w: torch.Tensor, a: torch.Tensor, terms: tuple[torch.Tensor, ...]) -> float:
    """``sum_alpha |(W D_alpha - A) x|^2`` of one output group from its terms:
    ``tr(W G W^T) - 2 tr(W RT A^T) + tr(A S A^T)``."""
    g, rt, s = terms
    return float(((w @ g) * w).sum() - 2 * ((w @ rt) * a).sum() + ((a @ s) * a).sum())


def fit_blocks(dense: torch.Tensor, moments: torch.Tensor, mask: np.ndarray,
               in_widths: Sequence[int], out_widths: Sequence[int],
               ridge: float = DEFAULT_RIDGE, cross: torch.Tensor | None = None
               ) -> torch.Tensor:
    """The calibrated weight ``(N, K)`` float64 (module docstring).

    Args:
        dense: ``A (N, K)``, the dense weight (the ridge's anchor).
        moments: ``C (q, K, K)``, each type's input second moments (float64).
        mask: the layer support ``(q, q, q)`` (``mask[alpha, beta, delta]``).
        in_widths, out_widths: the layer's group widths.
        ridge: relative ridge (``> 0``).
        cross: ``P (q, N, K) = sum y x^T`` per type, the targets' cross moments; ``None``
            = the dense projection's own outputs (``P_alpha = A C_alpha``).
    """
    a = dense.to(torch.float64)
    c = moments.to(torch.float64)
    out = torch.empty_like(a)
    oo = np.concatenate([[0], np.cumsum(out_widths)]).tolist()
    for delta in range(c.shape[0]):
        rows = slice(oo[delta], oo[delta + 1])
        g, rt, _ = _terms(c, mask, in_widths, delta)
        if cross is None:
            rhs_t = rt @ a[rows].T  # (K, N_delta)
        else:
            d = type_masks(mask, in_widths, delta)
            rhs_t = torch.einsum("ai,ani->in", d, cross.to(torch.float64)[:, rows])
        out[rows] = _solve_group(a[rows], g, rhs_t, ridge)
    return out


def block_error(weight: torch.Tensor, dense: torch.Tensor, moments: torch.Tensor,
                mask: np.ndarray, in_widths: Sequence[int], out_widths: Sequence[int]
                ) -> list[float]:
    """Per type, ``sum |W_eff x - A x|^2`` over the calibration inputs (float64)."""
    w, a = weight.to(torch.float64), dense.to(torch.float64)
    errs = []
    oo = np.concatenate([[0], np.cumsum(out_widths)]).tolist()
    for alpha in range(moments.shape[0]):
        eff = torch.zeros_like(w)
        for delta in range(len(out_widths)):
            rows = slice(oo[delta], oo[delta + 1])
            eff[rows] = w[rows] * type_masks(mask, in_widths, delta)[alpha]
        m = eff - a
        errs.append(float(((m @ moments[alpha].to(torch.float64)) * m).sum()))
    return errs


def calibration_batches(calibration: Any, vocab_size: int, batch_size: int = 4,
                        context: int | None = None) -> list[torch.Tensor]:
    """Token-id batches ``(B, T)`` from a tensor of ids ``(n, T)`` (split into batches of
    ``batch_size`` rows; a 1-D tensor is one sequence) or an iterable of batches (tensors,
    or dicts/tuples holding ``input_ids`` first), checked: integer ids ``(batch, seq)``
    within the vocabulary, ``seq`` within ``context`` positions (when given), at least
    one token. Iterates ``calibration`` once.

    Raises:
        ValueError: naming what is wrong (the batch, the value and what was expected).
    """
    if isinstance(calibration, str | bytes):
        raise ValueError("calibration must be token ids (a LongTensor (batch, seq)), not "
                         "text: tokenize it first")
    if isinstance(calibration, torch.Tensor):
        if calibration.dim() not in (1, 2):
            raise ValueError(f"calibration ids must have shape (batch, seq) (or (seq,) for "
                             f"one sequence), got shape {tuple(calibration.shape)}")
        ids = calibration if calibration.dim() == 2 else calibration.reshape(1, -1)
        items: Iterable[Any] = ids.split(batch_size)
    elif isinstance(calibration, Iterable):
        items = calibration
    else:
        raise ValueError(f"calibration must be token ids (a LongTensor (n, T)) or an "
                         f"iterable of batches, got {type(calibration).__name__}")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, Mapping):  # a dict, a tokenizer's BatchEncoding
            item = item.get("input_ids")
        elif isinstance(item, tuple | list):
            item = item[0] if item else None
        if not isinstance(item, torch.Tensor) or item.dtype.is_floating_point \
                or item.dtype.is_complex or item.dtype == torch.bool:
            got = item.dtype if isinstance(item, torch.Tensor) else type(item).__name__
            raise ValueError(f"calibration batch {i}: expected integer token ids, got {got}")
        if item.dim() not in (1, 2):
            raise ValueError(f"calibration batch {i}: expected ids of shape (batch, seq), got "
                             f"shape {tuple(item.shape)}")
        item = item if item.dim() == 2 else item.reshape(1, -1)
        if item.numel() and (int(item.min()) < 0 or int(item.max()) >= vocab_size):
            raise ValueError(f"calibration batch {i}: token ids must lie in [0, {vocab_size}) "
                             f"(the model's vocabulary), got {int(item.min())}..{int(item.max())}")
        if context is not None and item.shape[1] > context:
            raise ValueError(f"calibration batch {i}: sequences of {item.shape[1]} tokens are "
                             f"longer than the model's context of {context} positions: use "
                             f"windows of at most {context} tokens")
        if item.numel():
            out.append(item.long())
    if not out:
        raise ValueError("calibration holds no tokens")
    return out


RIDGES = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
"""The relative ridges ``ridge=None`` chooses from, per module, on held-out windows."""

HELD_OUT_EVERY = 8
"""With ``ridge=None``, every 8th calibration window is held out to choose the ridge
(and to report each module's error on text the fit did not see)."""


@dataclass
class _Batch:
    """One calibration batch as the decoder layers see it."""

    hidden: torch.Tensor  # the current layer's input (B, T, H)
    calls: list[tuple[tuple, dict[str, Any]]]  # per layer: the other args and kwargs
    positions: torch.Tensor | None  # the converted layers' position ids
    held_out: torch.Tensor  # (B,) bool: rows held out for the ridge choice


@dataclass
class _Stage:
    """Converted modules of one layer that read the same input."""

    layer: int
    order: int
    names: list[str] = field(default_factory=list)
    modules: list[TypedAlgebraLinear] = field(default_factory=list)


def _stages(model: nn.Module, names: Sequence[str]) -> list[_Stage]:
    """The converted modules grouped by (layer, stage), in forward order."""
    wanted = {id(model.get_submodule(n)): n for n in names}
    stages: dict[tuple[int, int], _Stage] = {}
    for layer in get_adapter(model).layers:
        for site in layer.linear_sites():
            module = site.module
            if id(module) not in wanted:
                continue
            key = (site.layer, min(_STAGE[t] for t in site.types))
            st = stages.setdefault(key, _Stage(*key))
            st.names.append(wanted[id(module)])
            st.modules.append(module)
    return [stages[k] for k in sorted(stages)]


def _capture(model: nn.Module, blocks: list[nn.Module], batches: list[torch.Tensor],
             source: Any, held_every: int) -> list[_Batch]:
    """Run the model once per batch, keeping the first block's input and every block's
    other arguments (attention masks, rotary tables, ... as the model made them)."""
    out: list[_Batch] = []
    row = 0
    for ids in batches:
        calls: list[tuple[tuple, dict[str, Any]]] = []
        first: list[torch.Tensor] = []

        def hook(module: nn.Module, args: tuple, kwargs: dict, calls=calls, first=first) -> None:
            if module is blocks[0]:
                first.append(args[0] if args else kwargs["hidden_states"])
            calls.append((args[1:] if args else (),
                          {k: v for k, v in kwargs.items() if k != "hidden_states"}))
            if len(calls) == len(blocks):
                raise StopForward

        with hooked(blocks, hook, with_kwargs=True):
            run_until_stopped(model, input_ids=ids, use_cache=False)
        rows = torch.arange(row, row + ids.shape[0])
        row += ids.shape[0]
        held = (rows % held_every == held_every - 1) if held_every else torch.zeros_like(
            rows, dtype=torch.bool)
        out.append(_Batch(first[0], calls, None if source is None else source.positions,
                          held))
    return out


def _run_block(block: nn.Module, batch: _Batch, layer: int, source: Any) -> Any:
    args, kwargs = batch.calls[layer]
    if source is not None and batch.positions is not None:
        source.set_positions(batch.positions)
    return block(batch.hidden, *args, **kwargs)


def _stage_moments(block: nn.Module, stage: list[TypedAlgebraLinear], batches: list[_Batch],
                   layer: int, source: Any) -> dict[int, tuple[torch.Tensor, torch.Tensor,
                                                            torch.Tensor]]:
    """Per module of ``stage``: per-type second moments of its input on the fitting rows
    and on the held-out rows, and the per-type token counts (float64)."""
    acc: dict[int, list[Any]] = {}
    current: dict[str, Any] = {}

    def hook(module: nn.Module, args: tuple) -> None:
        x = args[0]  # (B, T, K)
        key = (x.data_ptr(), tuple(x.shape))
        if current.get("key") != key:  # the modules of a stage usually share one input
            src = module.__dict__["_source"]
            pos = src.positions if src.positions.dim() == 2 else src.positions.unsqueeze(0)
            types = src.schedule.at_layer(module.layer_index)(pos.expand(*x.shape[:-1]))
            held = current["held"].view(-1, 1).expand(*x.shape[:-1]).reshape(-1)
            flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
            t = types.reshape(-1)
            parts = []
            for rows in (~held, held):
                parts.append(torch.stack([flat[rows & (t == a)].T @ flat[rows & (t == a)]
                                          for a in range(module.q)]))
            parts.append(torch.stack([(t == a).sum() for a in range(module.q)]))
            current.update(key=key, parts=parts)
        entry = acc.setdefault(id(module), [0, 0, 0])
        for i in range(3):
            entry[i] = entry[i] + current["parts"][i]
        current["seen"].add(id(module))
        if len(current["seen"]) == len(stage):
            raise StopForward

    with hooked(stage, hook):
        for b in batches:
            current.clear()
            current.update(held=b.held_out, seen=set())
            run_until_stopped(_run_block, block, b, layer, source)
    return {k: (v[0], v[1], v[2]) for k, v in acc.items()}


def _fit_module(m: TypedAlgebraLinear, fit_c: torch.Tensor, held_c: torch.Tensor,
                ridge: float | None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The calibrated weight of ``m`` and its summary; ``ridge=None`` picks the ridge with
    the least error on the held-out rows, then refits on all rows."""
    mask, iw, ow = m.support.mask, m.in_widths, m.out_widths
    a = m.weight.detach().to(torch.float64)
    every = fit_c + held_c
    oo = np.concatenate([[0], np.cumsum(ow)]).tolist()
    groups = [slice(oo[d], oo[d + 1]) for d in range(m.q)]

    def scale(c: torch.Tensor) -> float:
        return float(((a @ c.sum(0)) * a).sum()) or 1.0

    info: dict[str, Any] = {}
    if ridge is None and float(held_c.diagonal(dim1=1, dim2=2).sum()) > 0:
        trials: dict[float, float] = {}
        copy_held = 0.0
        fit_terms = [_terms(fit_c, mask, iw, d) for d in range(m.q)]
        held_terms = [_terms(held_c, mask, iw, d) for d in range(m.q)]
        for r in RIDGES:
            err = 0.0
            for d, rows in enumerate(groups):
                g, rt, _ = fit_terms[d]
                w = _solve_group(a[rows], g, rt @ a[rows].T, r)
                err += _group_error(w, a[rows], held_terms[d])
            trials[r] = err / scale(held_c)
        copy_held = sum(_group_error(a[rows], a[rows], held_terms[d])
                        for d, rows in enumerate(groups)) / scale(held_c)
        ridge = min(trials, key=trials.__getitem__)
        info["held_out"] = {"copy": copy_held, "calibrated": trials[ridge],
                            "by_ridge": {str(k): v for k, v in trials.items()}}
    ridge = DEFAULT_RIDGE if ridge is None else ridge
    fitted = fit_blocks(a, every, mask, iw, ow, ridge)
    total = scale(every)
    before = [e / total for e in block_error(a, a, every, mask, iw, ow)]
    after = [e / total for e in block_error(fitted, a, every, mask, iw, ow)]
    info.update(ridge=ridge, copy=sum(before), calibrated=sum(after),
                copy_per_type=before, calibrated_per_type=after)
    return fitted, info


@torch.no_grad()
def calibrate_(model: nn.Module, names: Sequence[str], calibration: Any,
               ridge: float | None = None, progress: bool = True) -> dict[str, Any]:
    """Refit the converted modules ``names`` of ``model`` in place, layer by layer
    (module docstring): the first block's inputs are captured once, every block then runs
    on the inputs the calibrated blocks before it produced. ``ridge=None`` chooses each
    module's ridge from :data:`RIDGES` on every 8th calibration window, held out. Returns
    a JSON-able summary: tokens, and per module the relative calibration error
    ``sum |W_eff x - A x|^2 / sum |A x|^2`` of the copy and of the fit (in total, per
    type, and on the held-out windows), the ridge and the tokens per type.

    Atomic: on any error (a position type that never occurs in a later layer's
    calibration tokens, an interrupt) every module refitted so far gets its weight back.

    Raises:
        ValueError: bad calibration ids (not integer ``(batch, seq)``, outside the
            vocabulary, longer than the model's context), or a position type that never
            occurs in them (its blocks would be fitted to nothing).
    """
    if ridge is not None and not ridge > 0:
        raise ValueError(f"ridge must be > 0 or None (chosen on held-out windows), got {ridge!r}")
    vocab = int(model.get_input_embeddings().weight.shape[0])
    batches = calibration_batches(calibration, vocab, context=model_context(model))
    n_rows = sum(b.shape[0] for b in batches)
    held_every = HELD_OUT_EVERY if ridge is None and n_rows >= HELD_OUT_EVERY else 0
    adapter = get_adapter(model)
    blocks = [layer.block for layer in adapter.layers]
    stages = _stages(model, names)
    source = stages[0].modules[0].__dict__["_source"] if stages else None
    was_training = model.training
    model.eval()
    summary: dict[str, Any] = {"tokens": int(sum(b.numel() for b in batches)),
                               "held_out_every": held_every, "modules": {}}
    thin: list[str] = []
    before: list[tuple[TypedAlgebraLinear, torch.Tensor]] = []  # each weight, once replaced
    try:
        cached = _capture(model, blocks, batches, source, held_every)
        last = max((st.layer for st in stages), default=-1)
        by_layer: dict[int, list[_Stage]] = {}
        for st in stages:
            by_layer.setdefault(st.layer, []).append(st)
        for layer in tqdm(range(last + 1), desc="calibrating", unit="layer",
                          disable=not progress):
            block = blocks[layer]
            for stage in by_layer.get(layer, []):
                moments = _stage_moments(block, stage.modules, cached, layer, source)
                for name, m in zip(stage.names, stage.modules, strict=True):
                    if id(m) not in moments:
                        raise RuntimeError(f"{name} never ran on the calibration batches")
                    fit_c, held_c, n = moments[id(m)]
                    absent = [a for a in range(m.q) if int(n[a]) == 0]
                    if absent:
                        raise ValueError(f"{name}: position types {absent} never occur in "
                                         "the calibration tokens; use longer or more windows")
                    if int(n.min()) < 2 * m.in_features:
                        thin.append(f"{name} ({int(n.min())} for {m.in_features} inputs)")
                    fitted, info = _fit_module(m, fit_c, held_c, ridge)
                    before.append((m, m.weight.detach().clone()))
                    m.weight.copy_(fitted.to(m.weight.dtype))
                    info["tokens_per_type"] = [int(v) for v in n]
                    summary["modules"][name] = info
                invalidate_fast_paths(model)  # weights changed in place: packed copies stale
            if layer < last:  # the next block's inputs, through the calibrated block
                for b in cached:
                    out = _run_block(block, b, layer, source)
                    b.hidden = out[0] if isinstance(out, tuple) else out
    except BaseException:
        for m, w in reversed(before):
            m.weight.copy_(w)
        invalidate_fast_paths(model)
        raise
    finally:
        model.train(was_training)
    if thin:
        warnings.warn(f"{len(thin)} calibrated modules saw fewer tokens of some position type "
                      "than twice their inputs, so the fit may follow the calibration text "
                      f"too closely (e.g. {thin[0]}); use at least 4 tokens per input and "
                      "type", UserWarning, stacklevel=3)
    return summary
