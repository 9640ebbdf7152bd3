"""Sibling projections of one input (q, k, v; gate, up) as one chain of the fused decode
step (``ops/csrc/decode_hf.cpp``), whose output is theirs concatenated — one call where
there were two or three, each paying a parallel region's start, its weight stream's
ramp-up and the allocations between calls:

* dense siblings: their weights stacked into one matrix;
* algebra siblings (one algebra, one input grouping, one position-type schedule): one
  typed weight whose output groups are the siblings' groups in turn (the input groups
  padded with empty ones to a square support), so each type's copy is the siblings'
  copies of that type back to back;
* two-factor siblings (one-sided or low-rank, ``x -> S (F x)``): the distinct first
  factors stacked (made once per set of factors, so that the layers sharing a basis share
  the stacked copy), then the second factors as one block-diagonal weight (a one-type
  support whose output groups each read their first factor's slice).

Anything else (mixed kinds, biases on some layers only are fine: missing ones are zeros)
returns ``None`` and the caller binds each projection on its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from structlm.nn import AlgebraLinear
from structlm.nn.factorized import LowRankLinear, OneSidedLinear
from structlm.ops import cpu_kernels
from structlm.ops.weight_arena import WeightArena

__all__ = ["Firsts", "dense_rows", "siblings"]


def dense_rows(mod: Any, w: torch.Tensor, arena: WeightArena) -> Any:
    """A dense ``(N, K)`` weight bound for the step (one type, one group), in the arena."""
    return mod.BoundRows(arena.place(w.detach().contiguous()),
                         *cpu_kernels.dense_tables(*w.shape), 1, -1)


def _two_factors(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(F, S)`` of a layer that is ``x -> S (F x)`` (+ bias), the parameters themselves (a
    shared basis is one object in every layer using it): a one-sided layer's basis and its
    own factor, a low-rank layer's ``C`` and ``B``; else ``None``."""
    if isinstance(module, OneSidedLinear):
        return module.basis.P, module.D
    if isinstance(module, LowRankLinear):
        return module.C, module.B
    return None


class Firsts:
    """The stacked first factors of two-factor siblings, made once per set of factors so
    that layers sharing their bases share one stacked copy (one per decode step build)."""

    def __init__(self) -> None:
        self._stacked: dict[tuple[int, ...], tuple[list[torch.Tensor], torch.Tensor]] = {}

    def stacked(self, firsts: list[torch.Tensor]) -> torch.Tensor:
        """``torch.cat(firsts)``, the same tensor for the same factors."""
        key = tuple(id(f) for f in firsts)
        if key not in self._stacked:  # the factors kept alive with it: ids stay theirs
            self._stacked[key] = (firsts, torch.cat([f.detach() for f in firsts]))
        return self._stacked[key][1]


def _bias(modules: list[nn.Module], widths: list[int]) -> torch.Tensor | None:
    """The siblings' biases concatenated (zeros for a sibling without one), or ``None``."""
    biases = [getattr(m, "bias", None) for m in modules]
    if all(b is None for b in biases):
        return None
    ref = next(b for b in biases if b is not None)
    return torch.cat([b.detach() if b is not None else ref.new_zeros(n)
                      for b, n in zip(biases, widths, strict=True)]).contiguous()


def _factor_siblings(mod: Any, modules: list[nn.Module], firsts: Firsts,
                     arena: WeightArena) -> Any | None:
    pairs = [_two_factors(m) for m in modules]
    if any(p is None for p in pairs):
        return None
    firsts_, group_of = [], []
    for f, _ in pairs:  # distinct first factors, by identity (a shared basis: once)
        index = next((i for i, g in enumerate(firsts_) if g is f), None)
        if index is None:
            index = len(firsts_)
            firsts_.append(f)
        group_of.append(index)
    q = len(modules)
    widths = [f.shape[0] for f in firsts_] + [0] * (q - len(firsts_))
    in_off = torch.tensor([0, *widths], dtype=torch.int64).cumsum(0)
    outs = [s.shape[0] for _, s in pairs]
    out_off = torch.tensor([0, *outs], dtype=torch.int64).cumsum(0)
    uses = torch.zeros(1, q, q, dtype=torch.uint8)
    for d, b in enumerate(group_of):
        uses[0, d, b] = 1
    first = dense_rows(mod, firsts.stacked(firsts_), arena)
    blocks = torch.cat([s.detach().reshape(-1) for _, s in pairs])  # group d: its block
    second = mod.BoundRows(arena.place(blocks), out_off, in_off, uses, q, -1)
    return mod.ChainLinear([[first, second]], _bias(modules, outs))


def _dense_siblings(mod: Any, modules: list[nn.Module], arena: WeightArena) -> Any | None:
    if not all(isinstance(m, nn.Linear) for m in modules):  # DecodeLinear included
        return None
    if len({(m.in_features, m.weight.dtype) for m in modules}) != 1:
        return None
    w = torch.cat([m.weight.detach() for m in modules])
    return mod.ChainLinear([[dense_rows(mod, w, arena)]],
                           _bias(modules, [m.out_features for m in modules]))


def _algebra_siblings(mod: Any, modules: list[nn.Module], slots: Any,
                      arena: WeightArena) -> Any | None:
    if not all(isinstance(m, AlgebraLinear) for m in modules):
        return None
    plans = [m.plan for m in modules]
    first = plans[0]
    if any(p.q != first.q or tuple(p.in_offsets) != tuple(first.in_offsets)
           or m.weight.dtype != modules[0].weight.dtype for p, m in zip(plans, modules,
                                                                        strict=True)):
        return None
    slot = {slots.slot(m) for m in modules}
    if len(slot) != 1:  # different position-type schedules: each its own types
        return None
    q, s = first.q, len(modules)
    tables = [cpu_kernels.block_tables(p) for p in plans]
    n_types = tables[0][2].shape[0]
    if any(t[2].shape[0] != n_types for t in tables):
        return None
    # output groups: every sibling's in turn; input groups: the q shared ones, then empty
    out_off, base = [0], 0
    for t, m in zip(tables, modules, strict=True):
        out_off += (t[0][1:] + base).tolist()
        base += m.out_features
    in_off = tables[0][1].tolist() + [int(tables[0][1][-1])] * (q * (s - 1))
    uses = torch.zeros(n_types, q * s, q * s, dtype=torch.uint8)
    for i, t in enumerate(tables):
        uses[:, i * q:(i + 1) * q, :q] = t[2]
    # each type's copy: the siblings' copies of that type back to back (from detached
    # views, so the copies are freed once placed in the arena; see fused_stack._chain)
    per_type = [cpu_kernels.typed_weight(m.weight.detach(), p).split(
        cpu_kernels.typed_copy_sizes(p)) for m, p in zip(modules, plans, strict=True)]
    typed = torch.cat([c[a] for a in range(n_types) for c in per_type])
    rows = mod.BoundRows(arena.place(typed), torch.tensor(out_off, dtype=torch.int64),
                         torch.tensor(in_off, dtype=torch.int64), uses, q * s, slot.pop())
    return mod.ChainLinear([[rows]], _bias(modules, [m.out_features for m in modules]))


def siblings(mod: Any, modules: list[nn.Module], slots: Any, firsts: Firsts,
             arena: WeightArena) -> Any | None:
    """Sibling projections of one input as one ``ChainLinear`` producing their outputs
    concatenated (see the module docstring), or ``None`` where they are not all of one
    kind that stacks (or fewer than two). ``slots`` gives an algebra layer's column of the
    step's type table."""
    if len(modules) < 2:
        return None
    chain = _factor_siblings(mod, modules, firsts, arena)
    if chain is None:
        chain = _dense_siblings(mod, modules, arena)
    if chain is None:
        chain = _algebra_siblings(mod, modules, slots, arena)
    return chain
