"""Attention heads and the algebra's groups: head-aligned group widths, and a
function-preserving permutation of whole heads before a conversion.

**Head-aligned groups** (``AlgebraConfig(groups="heads")``). An attention projection's
head side — the outputs of Q, K and V, the inputs of O — is ``heads × head_dim`` wide.
Equal algebra groups (``width / q``) cut across heads (SmolLM2: 64-wide heads, 144-wide
groups of ``Q2^2``), so one head's query is computed partly with one set of kept blocks
and partly with another. With head-aligned groups every group holds whole heads: ``n``
heads over ``q`` groups, ``n // q`` each and one more in the last ``n % q`` groups
(SmolLM2's 9 query heads under ``q = 4``: 2, 2, 2, 3 heads = 128, 128, 128, 192
features). A side with fewer heads than groups (SmolLM2's 3 K/V heads under ``q = 4``)
keeps equal groups, which then cut across its heads: whole heads cannot fill ``q``
groups. The hidden side (inputs of Q/K/V, outputs of O) keeps equal groups. The MAC
ratio of the algebra is unchanged for the catalogue's algebras (every group ``δ`` keeps
the same number of blocks summed over the types).

**Head permutation** (``permute=True`` with attention targets). Reordering the query
heads together with O's input columns, and the K/V heads with their query heads, leaves
the dense model's function unchanged when grouped-query attention's pairing is kept
(query head ``i`` reads K/V head ``i // r``, ``r = heads / kv_heads``): the K/V heads
are permuted, and the ``r`` query heads of each K/V head move with it, in any order
among themselves. The cost of a placement is the calibration error the dropped blocks
cause (:func:`structlm.convert.permute.input_cost` for the rows of Q, K and V,
:func:`~structlm.convert.permute.output_cost` for O's columns), summed over the head's
features. It is additive over K/V heads once each one's query heads are placed, so the
exact optimum is two levels of linear assignment: per (K/V head, K/V slot) the best
placement of its query heads in that slot's query slots, then the K/V heads to slots
(:func:`scipy.optimize.linear_sum_assignment`). Families with separate ``q/k/v/o_proj``
modules only (a fused qkv is refused); per-head q/k norms need nothing, full-width
ones (OLMo 2) are permuted with their projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from structlm.algebra import split_widths, support_of
from structlm.convert.calibrate import calibration_batches, model_context
from structlm.hf.adapters import MatrixType, get_adapter

__all__ = ["AttentionShape", "apply_head_orders_", "attention_shape", "head_widths",
           "permute_heads_", "site_widths"]


@dataclass(frozen=True)
class AttentionShape:
    """Query heads, K/V heads and the width of one head."""

    heads: int
    kv_heads: int
    head_dim: int


def attention_shape(model: nn.Module) -> AttentionShape:
    """The attention shape from the model's (text) config."""
    cfg = model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    if not heads:
        raise ValueError(f"{type(model).__name__}: the config names no attention heads")
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return AttentionShape(int(heads), int(kv), int(head_dim))


def head_widths(heads: int, head_dim: int, q: int) -> tuple[int, ...] | None:
    """Group widths holding whole heads (the last ``heads % q`` groups one head more);
    ``None`` when there are fewer heads than groups."""
    if heads < q:
        return None
    base, extra = divmod(heads, q)
    return tuple(head_dim * (base + (g >= q - extra)) for g in range(q))


def site_widths(types: tuple[MatrixType, ...], n_in: int, n_out: int, shape: AttentionShape,
                q: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(in_widths, out_widths)`` of one projection under head-aligned groups (equal
    widths wherever whole heads cannot fill the groups, and on the hidden side)."""
    def heads_or_equal(width: int, heads: int, what: str) -> tuple[int, ...]:
        if heads * shape.head_dim != width:
            raise ValueError(f"{what} is {width} wide, not {heads} heads x {shape.head_dim}")
        return head_widths(heads, shape.head_dim, q) or split_widths(width, q, what)

    in_w, out_w = split_widths(n_in, q, "in_features"), split_widths(n_out, q, "out_features")
    if types == (MatrixType.Q,):
        out_w = heads_or_equal(n_out, shape.heads, "the query projection's output")
    elif types in ((MatrixType.K,), (MatrixType.V,)):
        out_w = heads_or_equal(n_out, shape.kv_heads, "a key/value projection's output")
    elif types == (MatrixType.O,):
        in_w = heads_or_equal(n_in, shape.heads, "the output projection's input")
    elif set(types) & {MatrixType.Q, MatrixType.K, MatrixType.V, MatrixType.O}:
        raise ValueError("head-aligned groups need separate q/k/v/o projections, not a fused "
                         f"{'/'.join(t.value for t in types)} matrix")
    return in_w, out_w


def _attention_modules(layer: Any) -> dict[MatrixType, nn.Module]:
    mods: dict[MatrixType, nn.Module] = {}
    for site in layer.linear_sites():
        if len(site.types) == 1 and site.types[0] in (MatrixType.Q, MatrixType.K,
                                                       MatrixType.V, MatrixType.O):
            mods[site.types[0]] = site.module
        elif set(site.types) & {MatrixType.Q, MatrixType.K, MatrixType.V, MatrixType.O}:
            raise ValueError(f"layer {layer.index}: a fused "
                             f"{'/'.join(t.value for t in site.types)} projection: its heads "
                             "cannot be permuted as separate q/k/v/o matrices")
    if len(mods) != 4:
        raise ValueError(f"layer {layer.index}: expected q, k, v and o projections, found "
                         f"{sorted(t.value for t in mods)}")
    return mods


def _expand(order: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Head order (new slot -> old head) as a feature order."""
    return (order[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)


@torch.no_grad()
def apply_head_orders_(model: nn.Module, orders: dict[int, tuple[torch.Tensor, torch.Tensor]]
                       ) -> nn.Module:
    """Reorder the attention heads of ``model``'s layers by ``orders`` (layer index ->
    (query head order, K/V head order), new slot -> old head, as :func:`permute_heads_`
    chose them): Q/K/V rows and biases, O's input columns, full-width q/k norms. Every
    order is checked (a permutation of the query / K/V heads) before the first change.

    Raises:
        ValueError: an order that is not a permutation of its heads, a fused qkv.
    """
    from structlm.convert.permute import _permute, check_order

    shape = attention_shape(model)
    for layer in get_adapter(model).layers:
        if layer.index in orders:
            _attention_modules(layer)  # separate q/k/v/o, or a clear error
            pair = orders[layer.index]
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise ValueError(f"layer {layer.index}'s head orders: expected a pair "
                                 f"(query order, K/V order), got {type(pair).__name__}")
            check_order(pair[0], shape.heads, f"layer {layer.index}'s query head order")
            check_order(pair[1], shape.kv_heads, f"layer {layer.index}'s K/V head order")
    for layer in get_adapter(model).layers:
        if layer.index not in orders:
            continue
        q_order, kv_order = orders[layer.index]
        mods = _attention_modules(layer)
        qf, kvf = _expand(q_order, shape.head_dim), _expand(kv_order, shape.head_dim)
        _permute(mods[MatrixType.Q], qf, False, rows=True)
        _permute(mods[MatrixType.K], kvf, False, rows=True)
        _permute(mods[MatrixType.V], kvf, False, rows=True)
        _permute(mods[MatrixType.O], qf, False, rows=False)
        attn = getattr(layer, "block", None)
        attn = getattr(attn, "self_attn", None)
        for norm, feats in (("q_norm", qf), ("k_norm", kvf)):
            w = getattr(getattr(attn, norm, None), "weight", None)
            if w is not None and w.numel() == feats.numel():  # full width (OLMo 2)
                w.copy_(w.index_select(0, feats))
    return model


def _head_cost(rows: torch.Tensor, widths: tuple[int, ...], heads: int, head_dim: int
               ) -> torch.Tensor:
    """``(heads, heads)``: the cost of old head ``h`` in new slot ``s``, from the per-feature
    costs ``rows (heads*head_dim, q)`` and the groups ``widths`` of the head side."""
    group = torch.as_tensor(np.repeat(np.arange(len(widths)), widths))  # feature -> group
    per = rows.reshape(heads, head_dim, -1)  # (h, d, q)
    slot_groups = group.reshape(heads, head_dim)  # (s, d): group of slot s's feature d
    idx = slot_groups.unsqueeze(0).expand(heads, heads, head_dim)  # (h, s, d)
    return per.unsqueeze(1).expand(heads, heads, head_dim, per.shape[-1]).gather(
        3, idx.unsqueeze(-1)).squeeze(-1).sum(-1)


def _solve_heads(q_cost: torch.Tensor, kv_cost: torch.Tensor, r: int
                 ) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """The optimal (query order, K/V order) and the cost of the identity and of it."""
    from scipy.optimize import linear_sum_assignment

    n_kv = kv_cost.shape[0]
    total = kv_cost.clone()
    inner: dict[tuple[int, int], np.ndarray] = {}
    for k in range(n_kv):
        for t in range(n_kv):
            sub = q_cost[k * r:(k + 1) * r, t * r:(t + 1) * r].numpy()
            rows, cols = linear_sum_assignment(sub)
            total[k, t] += float(sub[rows, cols].sum())
            inner[(k, t)] = np.empty(r, dtype=np.int64)
            inner[(k, t)][cols] = k * r + rows  # slot in block -> old query head
    kv_rows, kv_cols = linear_sum_assignment(total.numpy())
    kv_order = np.empty(n_kv, dtype=np.int64)
    kv_order[kv_cols] = kv_rows
    q_order = np.concatenate([inner[(int(kv_order[t]), t)] for t in range(n_kv)])
    identity = float(kv_cost.diagonal().sum() + q_cost.diagonal().sum())
    return (torch.as_tensor(q_order), torch.as_tensor(kv_order), identity,
            float(total.numpy()[kv_rows, kv_cols].sum()))


@torch.no_grad()
def permute_heads_(model: nn.Module, algebra: Any, schedule: Any, calibration: Any,
                   progress: bool = True,
                   orders: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
                   ) -> dict[str, Any]:
    """Reorder every layer's attention heads of the (dense) ``model`` in place so that the
    conversion to ``algebra`` with head-aligned groups and position-type ``schedule``
    drops as little calibration error as possible (module docstring); the dense function
    is unchanged. Returns per layer the assignment cost of the identity order and of the
    chosen one; ``orders``, if given, receives each layer's (query, K/V) head orders (for
    :func:`apply_head_orders_`).

    Raises:
        ValueError: a fused qkv projection, or widths that are not whole heads.
    """
    from structlm.convert.permute import _statistics, _weight, input_cost, output_cost

    adapter = get_adapter(model)
    mask = support_of(algebra).mask
    q = mask.shape[0]
    shape = attention_shape(model)
    if shape.heads % shape.kv_heads:
        raise ValueError(f"{shape.heads} query heads are not a multiple of "
                         f"{shape.kv_heads} K/V heads")
    r = shape.heads // shape.kv_heads
    layers = []
    for layer in adapter.layers:
        mods = _attention_modules(layer)
        hidden = _weight(mods[MatrixType.Q], False).shape[1]
        width = shape.heads * shape.head_dim
        layers.append({"layer": layer.index, "mods": mods, "in": [mods[MatrixType.Q]],
                       "out": mods[MatrixType.O],
                       "x": torch.zeros(q, hidden, hidden, dtype=torch.float64),
                       "h2": torch.zeros(q, width, dtype=torch.float64)})
    vocab = int(model.get_input_embeddings().weight.shape[0])
    _statistics(model, layers, calibration_batches(calibration, vocab,
                                                   context=model_context(model)),
                schedule, q, progress)
    summary: dict[str, Any] = {}
    chosen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for e in layers:
        mods = e["mods"]
        w = {t: _weight(m, False) for t, m in mods.items()}
        hw = split_widths(w[MatrixType.Q].shape[1], q, "hidden size")
        ow = split_widths(w[MatrixType.O].shape[0], q, "hidden size")
        q_w = site_widths((MatrixType.Q,), w[MatrixType.Q].shape[1], w[MatrixType.Q].shape[0],
                          shape, q)[1]
        kv_w = site_widths((MatrixType.K,), w[MatrixType.K].shape[1],
                           w[MatrixType.K].shape[0], shape, q)[1]
        q_rows = (input_cost([w[MatrixType.Q]], e["x"], mask, hw)
                  + output_cost(w[MatrixType.O], e["h2"], mask, ow))
        kv_rows = input_cost([w[MatrixType.K], w[MatrixType.V]], e["x"], mask, hw)
        q_order, kv_order, before, after = _solve_heads(
            _head_cost(q_rows, q_w, shape.heads, shape.head_dim),
            _head_cost(kv_rows, kv_w, shape.kv_heads, shape.head_dim), r)
        chosen[e["layer"]] = (q_order, kv_order)
        summary[f"layer {e['layer']} heads"] = {"identity": before, "permuted": after}
    for index, pair in chosen.items():  # every order chosen before the first change
        if orders is not None:
            orders[index] = pair
        apply_head_orders_(model, {index: pair})
    return summary

