"""Test helpers around the route (structlm.ops.route)."""

from __future__ import annotations

import torch

from structlm.ops.partition import TypePartition
from structlm.ops.plan import BlockPlan
from structlm.ops.route import (
    THRESHOLDS,
    AlgebraCall,
    Backend,
    DenseCall,
    Route,
    choose,
    paired_panels,
)


def layout_of(plan: BlockPlan, part: TypePartition, x: torch.Tensor, w: torch.Tensor,
              kernel: bool = True) -> Route:
    """The blocked backend's route for ``x (M, K)`` and ``w (N, K)``."""
    return choose(AlgebraCall(x, w, plan, part, Backend.BLOCKED, kernel=kernel)).route


def kernel_rows_per_type(dtype: torch.dtype) -> int:
    """The most rows per type the route gives the compiled kernel in ``dtype`` on this
    build (float32 with the AVX-512 loops: ``kernel_max_rows_per_type``)."""
    name = ("kernel_max_rows_per_type" if dtype == torch.float32 and paired_panels()
            else "kernel_portable_max_rows_per_type")
    return THRESHOLDS[name].value


def dense_on_kernel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> bool:
    """Whether the route sends this dense projection to the compiled kernel."""
    return choose(DenseCall(x, w, b)).route is not Route.TORCH


def on_stack(model: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None,
             cache: object) -> bool:
    """Whether the route runs a StructLM model's forward of ``x`` on the decode stack."""
    from structlm.ops.route import Route

    return model.decode_accelerator.decision(model, x, mask, cache) is Route.DECODE_STACK
