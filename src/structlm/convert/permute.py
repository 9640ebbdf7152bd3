"""A function-preserving permutation of the FFN hidden units before a conversion.

Reordering the hidden units of an FFN — the rows of its input projections (gate and up,
or GPT-2's ``c_fc``) and the same columns of its output projection — leaves the dense
model's function unchanged, but decides which weights each position type keeps once the
FFN is converted: unit ``j`` placed in group ``g`` is an output row of group ``g`` of
the input projections and an input column of group ``g`` of the output projection.

The cost of placing unit ``j`` in group ``g`` is the calibration error its weights then
cause, summed over types, each projection's share relative to its dense output energy:

* input projection ``A``: ``sum_alpha a_{j,D}^T C_alpha[D, D] a_{j,D}``, ``D`` the input
  groups type ``alpha`` drops for output group ``g`` (exact per row);
* output projection ``B``: ``sum_alpha s_alpha[j] sum_delta [dropped] |B[delta, j]|^2``,
  ``s_alpha[j]`` the unit's squared activation summed over type ``alpha``'s tokens (the
  diagonal of its second moments: the cross terms depend on the whole assignment).

Groups hold ``F / q`` units each; the assignment minimising the summed cost is a linear
assignment problem, solved exactly by :func:`scipy.optimize.linear_sum_assignment` (each
group's column repeated once per slot). Statistics come from the dense model on the
calibration batches in float64 (positions ``0..T-1``: unpadded windows). Fused
gate/up projections (Phi-3) are refused: their groups cut across the two halves.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from structlm.algebra import split_widths, support_of
from structlm.convert.calibrate import calibration_batches, model_context, type_masks
from structlm.hf.adapters import MatrixType, get_adapter
from structlm.hf.hooks import hooked

__all__ = ["apply_ffn_orders_", "assignment_cost", "check_order", "input_cost", "output_cost",
           "permute_ffn_"]


def _weight(module: nn.Module, conv1d: bool) -> torch.Tensor:
    """The ``(out, in)`` weight of a Linear or a GPT-2 Conv1D."""
    w = module.weight.detach()
    return w.t() if conv1d else w


def input_cost(proj_in: Sequence[torch.Tensor], x_moments: torch.Tensor, mask: np.ndarray,
               hidden_widths: Sequence[int]) -> torch.Tensor:
    """``(F, q)`` float64: the input projections' part of the cost of output row ``j`` in
    group ``g`` (module docstring), each projection relative to its dense output energy.

    Args:
        proj_in: the input projections' weights ``(F, H)`` (gate, up; or one).
        x_moments: ``(q, H, H)`` per-type second moments of their input.
        hidden_widths: the ``H`` side's groups.
    """
    q = mask.shape[0]
    cost = torch.zeros(proj_in[0].shape[0], q, dtype=torch.float64)
    for a in proj_in:
        a = a.to(torch.float64)
        total = sum(float(((a @ x_moments[t]) * a).sum()) for t in range(q)) or 1.0
        for g in range(q):
            dropped = 1.0 - type_masks(mask, hidden_widths, g)  # (q, H)
            for t in range(q):
                m = a * dropped[t]
                cost[:, g] += ((m @ x_moments[t]) * m).sum(1) / total
    return cost


def output_cost(proj_out: torch.Tensor, h_squares: torch.Tensor, mask: np.ndarray,
                hidden_widths: Sequence[int]) -> torch.Tensor:
    """``(F, q)`` float64: the output projection's part of the cost of input column ``j``
    in group ``g`` (module docstring), relative to its dense output energy.

    Args:
        proj_out: the output projection's weight ``(H, F)``.
        h_squares: ``(q, F)`` per-type sums of each input unit's squared activation.
        hidden_widths: the ``H`` side's groups.
    """
    q = mask.shape[0]
    cost = torch.zeros(proj_out.shape[1], q, dtype=torch.float64)
    b = proj_out.to(torch.float64)
    ho = np.concatenate([[0], np.cumsum(hidden_widths)]).tolist()
    col = torch.stack([(b[ho[d]:ho[d + 1]] ** 2).sum(0) for d in range(q)])  # (q, F)
    total = float((h_squares.sum(0) * (b ** 2).sum(0)).sum()) or 1.0
    keep = torch.as_tensor(np.asarray(mask, dtype=np.float64))  # [alpha, g, delta]
    for g in range(q):
        for t in range(q):
            cost[:, g] += h_squares[t] * ((1.0 - keep[t, g]) @ col) / total
    return cost


def assignment_cost(proj_in: Sequence[torch.Tensor], proj_out: torch.Tensor,
                    x_moments: torch.Tensor, h_squares: torch.Tensor, mask: np.ndarray,
                    hidden_widths: Sequence[int], unit_widths: Sequence[int]) -> torch.Tensor:
    """``(F, q)`` float64: the cost of unit ``j`` in group ``g`` (module docstring):
    :func:`input_cost` + :func:`output_cost`.

    Args:
        proj_in: the input projections' weights ``(F, H)`` (gate, up; or one).
        proj_out: the output projection's weight ``(H, F)``.
        x_moments: ``(q, H, H)`` per-type second moments of the FFN's input.
        h_squares: ``(q, F)`` per-type sums of each hidden unit's squared activation.
        hidden_widths: the ``H`` side's groups; ``unit_widths``: the ``F`` side's.
    """
    return (input_cost(proj_in, x_moments, mask, hidden_widths)
            + output_cost(proj_out, h_squares, mask, hidden_widths))


def _solve(cost: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
    """The order of the units (new position -> old unit) minimising the summed cost with
    ``widths[g]`` units in group ``g``."""
    from scipy.optimize import linear_sum_assignment

    slots = np.repeat(np.arange(len(widths)), widths)  # slot -> group
    rows, cols = linear_sum_assignment(cost.numpy()[:, slots])
    group = np.empty(cost.shape[0], dtype=np.int64)
    group[rows] = slots[cols]
    return torch.as_tensor(np.argsort(group, kind="stable"))  # by group, then unit index


@torch.no_grad()
def _statistics(model: nn.Module, layers: list[dict[str, Any]], batches: list[torch.Tensor],
                schedule: Any, q: int, progress: bool) -> None:
    """Per layer: per-type FFN input moments and hidden squares, from the dense model."""
    def types_of(x: torch.Tensor, layer: int) -> torch.Tensor:
        b, t = x.shape[:2]
        pos = torch.arange(t).expand(b, t)
        return schedule.at_layer(layer)(pos).reshape(-1)

    def hook_in(entry: dict[str, Any]):
        def hook(_m: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
            ty = types_of(args[0], entry["layer"])
            entry["x"] += torch.stack([x[ty == a].T @ x[ty == a] for a in range(q)])
        return hook

    def hook_out(entry: dict[str, Any]):
        def hook(_m: nn.Module, args: tuple) -> None:
            h = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
            ty = types_of(args[0], entry["layer"])
            entry["h2"] += torch.stack([(h[ty == a] ** 2).sum(0) for a in range(q)])
        return hook

    with ExitStack() as stack:
        for e in layers:
            stack.enter_context(hooked([e["in"][0]], hook_in(e)))
            stack.enter_context(hooked([e["out"]], hook_out(e)))
        for ids in tqdm(batches, desc="permutation statistics", unit="batch",
                        disable=not progress):
            model(input_ids=ids)


def check_order(order: Any, n: int, what: str) -> None:
    """Refuse an ``order`` that is not a permutation of ``range(n)`` (an integer tensor).

    Raises:
        ValueError: naming ``what``, the order's shape or values and ``n``.
    """
    if not isinstance(order, torch.Tensor) or order.dtype.is_floating_point \
            or order.dtype == torch.bool or order.dim() != 1 or order.numel() != n:
        got = (f"{order.dtype} of shape {tuple(order.shape)}" if isinstance(order, torch.Tensor)
               else type(order).__name__)
        raise ValueError(f"{what}: expected an integer tensor of shape ({n},) (a permutation "
                         f"of 0..{n - 1}), got {got}")
    if not torch.equal(order.sort().values.cpu(), torch.arange(n)):
        raise ValueError(f"{what}: not a permutation of 0..{n - 1} (values repeat or lie "
                         "outside)")


@torch.no_grad()
def apply_ffn_orders_(model: nn.Module, orders: dict[int, torch.Tensor]) -> nn.Module:
    """Reorder the FFN hidden units of ``model``'s layers by ``orders`` (layer index ->
    new position -> old unit, as :func:`permute_ffn_` chose them): e.g. to give a dense
    teacher the layout of a permuted, converted student. Every order is checked (a
    permutation of the layer's FFN width) before the first change.

    Raises:
        ValueError: an order that is not a permutation of its layer's FFN units.
    """
    adapter = get_adapter(model)
    for layer in adapter.layers:
        if layer.index in orders:
            out = [s.module for s in layer.linear_sites() if s.types == (MatrixType.MLP_OUT,)]
            width = _weight(out[0], adapter.conv1d_layout).shape[1]
            check_order(orders[layer.index], width, f"layer {layer.index}'s FFN order")
    for layer in adapter.layers:
        if layer.index not in orders:
            continue
        for site in layer.linear_sites():
            if site.types == (MatrixType.MLP_IN,):
                _permute(site.module, orders[layer.index], adapter.conv1d_layout, rows=True)
            elif site.types == (MatrixType.MLP_OUT,):
                _permute(site.module, orders[layer.index], adapter.conv1d_layout, rows=False)
    return model


@torch.no_grad()
def permute_ffn_(model: nn.Module, algebra: Any, schedule: Any, calibration: Any,
                 progress: bool = True,
                 orders: dict[int, torch.Tensor] | None = None) -> dict[str, Any]:
    """Reorder every FFN's hidden units of the (dense) ``model`` in place so that the
    conversion to ``algebra`` (an :class:`~structlm.algebra.Algebra`) with position-type
    ``schedule`` (a :class:`~structlm.nn.schedules.TypeSchedule`) drops as little
    calibration error as possible; the dense function is unchanged. Returns per layer
    the assignment cost of the identity order and of the chosen one; ``orders``, if
    given, receives each layer's order (for :func:`apply_ffn_orders_`).

    Raises:
        ValueError: a fused gate/up projection, or widths ``q`` does not divide.
    """
    adapter = get_adapter(model)
    mask = support_of(algebra).mask
    q = mask.shape[0]
    conv1d = adapter.conv1d_layout
    layers = []
    for layer in adapter.layers:
        sites = layer.linear_sites()
        ins = [s.module for s in sites if s.types == (MatrixType.MLP_IN,)]
        out = [s.module for s in sites if s.types == (MatrixType.MLP_OUT,)]
        w_out = _weight(out[0], conv1d)
        f, h = w_out.shape[1], w_out.shape[0]
        if any(_weight(m, conv1d).shape[0] != f for m in ins):
            raise ValueError(f"layer {layer.index}: the FFN input projection is fused "
                             "(gate and up in one matrix): its hidden units cannot be "
                             "permuted as one")
        layers.append({"layer": layer.index, "in": ins, "out": out[0], "f": f, "hidden": h,
                       "x": torch.zeros(q, h, h, dtype=torch.float64),
                       "h2": torch.zeros(q, f, dtype=torch.float64)})
    vocab = int(model.get_input_embeddings().weight.shape[0])
    batches = calibration_batches(calibration, vocab, context=model_context(model))
    _statistics(model, layers, batches, schedule, q, progress)
    summary: dict[str, Any] = {}
    chosen_orders: list[tuple[dict[str, Any], torch.Tensor]] = []
    for e in layers:
        hw = split_widths(e["hidden"], q, "hidden size")
        uw = split_widths(e["f"], q, "FFN width")
        cost = assignment_cost([_weight(m, conv1d) for m in e["in"]], _weight(e["out"], conv1d),
                               e["x"], e["h2"], mask, hw, uw)
        order = _solve(cost, uw)
        identity = torch.repeat_interleave(torch.arange(q), torch.tensor(list(uw)))
        chosen = torch.repeat_interleave(torch.arange(q), torch.tensor(list(uw)))
        before = float(cost[torch.arange(e["f"]), identity].sum())
        after = float(cost[order, chosen].sum())
        chosen_orders.append((e, order))
        summary[f"layer {e['layer']}"] = {"identity": before, "permuted": after}
    for e, order in chosen_orders:  # every order chosen before the first change
        if orders is not None:
            orders[e["layer"]] = order
        for m in e["in"]:
            _permute(m, order, conv1d, rows=True)
        _permute(e["out"], order, conv1d, rows=False)
    return summary


def _permute(module: nn.Module, order: torch.Tensor, conv1d: bool, rows: bool) -> None:
    """Reorder a projection's hidden side: output rows (and bias) of an input projection,
    input columns of the output projection (in the module's own weight layout)."""
    w = module.weight
    hidden_axis = (1 if conv1d else 0) if rows else (0 if conv1d else 1)
    w.copy_(w.index_select(hidden_axis, order))
    if rows and getattr(module, "bias", None) is not None:
        module.bias.copy_(module.bias.index_select(0, order))
