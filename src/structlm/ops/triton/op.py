"""``torch.library`` custom ops (+ fake implementations + autograd) for the kernels.

Registered ops: ``structlm::algebra_linear`` (forward), ``structlm::algebra_linear_dx``
and ``structlm::algebra_linear_dw``; ``torch.compile(fullgraph=True)`` traces them
through their fake implementations. The layer's static tables are registered once and
passed by an integer key; the batch's types are a tensor, so a decode position offset
never needs a host synchronisation.
"""

from __future__ import annotations

from typing import Any

import torch

from structlm.ops.route import Route
from structlm.ops.triton.launch import launch_dw, launch_dx, launch_forward
from structlm.ops.triton.tables import SupportTables

__all__ = ["algebra_linear", "register_tables", "triton_linear"]

_TABLES: list[SupportTables] = []
_TABLE_KEYS: dict[tuple[int, ...], int] = {}


def register_tables(tables: SupportTables) -> int:
    """Keep ``tables`` alive for the ops; returns the key to pass them by. Tables with the
    same contents share one key, so the registry grows with the distinct supports, widths
    and devices in use, not with the layers built."""
    sig = tables.signature()
    key = _TABLE_KEYS.get(sig)
    if key is None:
        _TABLES.append(tables)
        key = _TABLE_KEYS[sig] = len(_TABLES) - 1
    return key


@torch.library.custom_op("structlm::algebra_linear", mutates_args=())
def algebra_linear(x: torch.Tensor, weight: torch.Tensor, types: torch.Tensor,
                   tables_id: int, mode: str) -> torch.Tensor:
    """``y (M, N)`` of the algebra product for ``x (M, K)`` and ``types (M,)``."""
    return launch_forward(x, weight, types, _TABLES[tables_id], mode)


@algebra_linear.register_fake
def _algebra_linear_fake(x: torch.Tensor, weight: torch.Tensor, types: torch.Tensor,
                         tables_id: int, mode: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("structlm::algebra_linear_dx", mutates_args=())
def algebra_linear_dx(gy: torch.Tensor, weight: torch.Tensor, types: torch.Tensor,
                      tables_id: int) -> torch.Tensor:
    """``dX (M, K)`` over the transposed support."""
    return launch_dx(gy, weight, types, _TABLES[tables_id])


@algebra_linear_dx.register_fake
def _algebra_linear_dx_fake(gy: torch.Tensor, weight: torch.Tensor, types: torch.Tensor,
                            tables_id: int) -> torch.Tensor:
    return gy.new_empty(gy.shape[0], weight.shape[1])


@torch.library.custom_op("structlm::algebra_linear_dw", mutates_args=())
def algebra_linear_dw(gy: torch.Tensor, x: torch.Tensor, types: torch.Tensor,
                      tables_id: int) -> torch.Tensor:
    """``dW (N, K)``: per used block, over the rows of the types using it."""
    return launch_dw(gy, x, types, _TABLES[tables_id], (gy.shape[1], x.shape[1]))


@algebra_linear_dw.register_fake
def _algebra_linear_dw_fake(gy: torch.Tensor, x: torch.Tensor, types: torch.Tensor,
                            tables_id: int) -> torch.Tensor:
    return gy.new_empty(gy.shape[1], x.shape[1])


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, types, tables_id, _ = inputs
    ctx.save_for_backward(x, weight, types)
    ctx.tables_id = tables_id


def _backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:
    x, weight, types = ctx.saved_tensors
    gy = gy.contiguous()
    dx = algebra_linear_dx(gy, weight, types, ctx.tables_id) if ctx.needs_input_grad[0] else None
    dw = algebra_linear_dw(gy, x, types, ctx.tables_id) if ctx.needs_input_grad[1] else None
    return dx, dw, None, None, None


algebra_linear.register_autograd(_backward, setup_context=_setup_context)


_MODES = {Route.TRITON_DECODE: "decode", Route.TRITON_FUSED: "fused",
          Route.TRITON_TWO_STAGE: "two-stage"}


def triton_linear(x: torch.Tensor, weight: torch.Tensor, types: torch.Tensor,
                  tables_id: int, route: Route) -> torch.Tensor:
    """``x (M, K)``, ``weight (N, K)``, ``types (M,)`` -> ``(M, N)`` via the kernels, in the
    forward mode of ``route`` (:func:`structlm.ops.route.choose`)."""
    mode = _MODES[route]
    return algebra_linear(x.contiguous(), weight.contiguous(), types.contiguous(), tables_id,
                          mode)
