"""Fused forms of a whole SwiGLU FFN and of a whole stack of pre-norm decoder blocks, on
the compiled CPU kernels (one call each instead of a dozen small ops).

These are the kernels the StructLM model's decode path calls once the route
(:func:`structlm.ops.route.choose`) has chosen :attr:`~structlm.ops.route.Route.SWIGLU_KERNEL`
or :attr:`~structlm.ops.route.Route.DECODE_STACK`; the model supplies its tensors, this
module owns the kernel calls (models import no kernel module).
"""

from __future__ import annotations

import torch

from structlm.ops import cpu_kernels
from structlm.ops.partition import TypePartition
from structlm.ops.plan import BlockPlan

__all__ = ["decode_stack", "ffn_kernel_args", "swiglu_rows", "typed_decode"]


def swiglu_rows(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                plans: tuple[BlockPlan, BlockPlan] | None = None,
                part: TypePartition | None = None) -> torch.Tensor:
    """``(M, D) -> (M, D)``: ``down(silu(gate(x)) * up(x))`` for a few rows in one call
    (CPU, no autograd). ``plans = (gate/up plan, down plan)`` and ``part`` for algebra
    projections, ``None`` for dense ones."""
    return cpu_kernels.swiglu_rows(x, gate, up, down, plans, part)  # (M, D)


def ffn_kernel_args(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                    plans: tuple[BlockPlan, BlockPlan] | None, typed: bool
                    ) -> list[torch.Tensor]:
    """A SwiGLU FFN's weights and support tables as :func:`decode_stack` takes them (the
    typed or panel-packed weight copies of algebra projections, made on first use)."""
    return cpu_kernels.ffn_kernel_args(gate, up, down, plans, typed)


def typed_decode(types: torch.Tensor | None) -> bool:
    """Whether a decode step with these row types ``(B,)`` reads the typed weight copies
    (``None``: a dense FFN, always): every row of one type and the typed copy chosen
    (:func:`structlm.ops.cpu_kernels.decode_copy`)."""
    if types is None:
        return True
    return (cpu_kernels.decode_copy_mode() == "typed"
            and (types.numel() == 1 or bool((types == types[0]).all())))


def decode_stack(x: torch.Tensor, dense: list[list[torch.Tensor]], eps: list[float],
                 k_bufs: list[torch.Tensor], v_bufs: list[torch.Tensor], past: int,
                 ffn: list[list[torch.Tensor]], types: torch.Tensor, q: int, typed: bool
                 ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """``(M, D) -> (M, D)``: every pre-norm decoder block (``x + attn(ln_1(x))``, then
    ``+ ffn(ln_2(.))``) for one new token per sequence in one call of the compiled kernel
    (``ops/csrc/decode_block.cpp``; CPU, no autograd).

    Per block (the lists hold one entry each): ``dense`` = ln_1 weight and bias, qkv
    weight and bias, proj weight and bias, ln_2 weight and bias; the new key and value
    are written at position ``past`` of the caches ``k_bufs``/``v_bufs``
    ``(M, n_head, capacity, hs)`` and attention covers positions ``0 .. past`` (no
    padding); ``ffn`` is :func:`ffn_kernel_args`; ``types (M,)`` int64 and ``q`` the FFN's
    types (1: dense). Returns the output ``(M, D)`` and each block's keys and values over
    positions ``0 .. past`` (views of the caches, ``(M, n_head, past + 1, hs)``)."""
    mod = cpu_kernels.kernel_for(x, dense[0][2] if dense else x)
    out = mod.decode_stack_forward(x, dense, eps, k_bufs, v_bufs, past, ffn, types, q, typed)
    return out[0], out[1::2], out[2::2]
