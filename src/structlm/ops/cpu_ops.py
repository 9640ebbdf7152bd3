"""``torch.library`` custom ops for the compiled few-row CPU kernels (:mod:`.cpu_kernels`).

Registered ops, each with a fake implementation so ``torch.compile`` / ``torch.export``
trace them as opaque calls instead of tracing into pybind11 (the Triton kernels are
registered the same way, :mod:`.triton.op`):

* ``structlm::cpu_rows_linear`` — ``y (M, N)`` of a few rows on the support-driven loop,
  from the panel-packed or the typed weight copy;
* ``structlm::cpu_dense_rows`` — ``y (M, N)`` of a few rows of a dense weight on the
  same loop;
* ``structlm::cpu_swiglu_rows`` — ``down(silu(gate(x)) * up(x))`` for a few rows.

The whole-stack decode step (``decode_stack_forward``) is not an op: it writes the KV
caches in place and returns views of them, which a custom op may not (outputs must not
alias inputs). It runs only in eager decoding, behind the decode step's own gate
(:mod:`structlm.models.decode_step`).

Eager calls skip the op wrapper: :func:`rows_linear`, :func:`dense_rows` and
:func:`swiglu_rows` call the kernel directly unless ``torch.compile`` or ``torch.jit``
is tracing, because the custom-op wrapper costs ~28 µs a call on this machine (measured:
a 256×256 few-row product took 6 µs direct, 34 µs through the op), as much as the whole
bookkeeping the few-row path exists to skip in a decode step.

None of these ops has an autograd formula: the kernels serve inference, and every
caller's route (:func:`structlm.ops.route.choose`) refuses inputs that need a
gradient, so training goes through the blocked backend's autograd function.
"""

from __future__ import annotations

import torch

from structlm.ops.cpu_extension import extension
from structlm.ops.route import tracing

__all__ = ["cpu_dense_rows", "cpu_rows_linear", "cpu_swiglu_rows", "dense_rows",
           "rows_linear", "swiglu_rows", "tracing"]


def _kernel():
    mod = extension()
    if mod is None:
        raise RuntimeError("the CPU fused-rows kernel is not available (see the warning above)")
    return mod


@torch.library.custom_op("structlm::cpu_rows_linear", mutates_args=())
def cpu_rows_linear(x: torch.Tensor, w_copy: torch.Tensor, types: torch.Tensor,
                    out_off: torch.Tensor, in_off: torch.Tensor, uses: torch.Tensor, q: int,
                    n: int, bias: torch.Tensor | None, typed: bool) -> torch.Tensor:
    """``(M, K) -> (M, n)``: ``x W_eff(type)^T (+ bias)`` from the typed copies
    (``typed``) or the panel-packed copy of the weight."""
    mod = _kernel()
    fn = mod.typed_rows_forward if typed else mod.fused_rows_forward
    return fn(x, w_copy, types, out_off, in_off, uses, q, bias)


@cpu_rows_linear.register_fake
def _cpu_rows_linear_fake(x: torch.Tensor, w_copy: torch.Tensor, types: torch.Tensor,
                          out_off: torch.Tensor, in_off: torch.Tensor, uses: torch.Tensor,
                          q: int, n: int, bias: torch.Tensor | None,
                          typed: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


@torch.library.custom_op("structlm::cpu_dense_rows", mutates_args=())
def cpu_dense_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(M, K) -> (M, N)``: ``x W^T (+ bias)`` for a few rows."""
    return _kernel().dense_rows_forward(x, w, bias)


@cpu_dense_rows.register_fake
def _cpu_dense_rows_fake(x: torch.Tensor, w: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("structlm::cpu_swiglu_rows", mutates_args=())
def cpu_swiglu_rows(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    down: torch.Tensor, types: torch.Tensor, tables: list[torch.Tensor],
                    q: int, typed: bool) -> torch.Tensor:
    """``(M, D) -> (M, D)``: the SwiGLU FFN of a few rows; ``tables`` are the gate/up
    tables then the down tables (three each, :func:`.cpu_kernels.block_tables`)."""
    return _kernel().swiglu_rows_forward(x, gate, up, down, types, *tables, q, typed)


@cpu_swiglu_rows.register_fake
def _cpu_swiglu_rows_fake(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                          down: torch.Tensor, types: torch.Tensor, tables: list[torch.Tensor],
                          q: int, typed: bool) -> torch.Tensor:
    return x.new_empty(x.shape)


def rows_linear(x: torch.Tensor, w_copy: torch.Tensor, types: torch.Tensor,
                tables: tuple[torch.Tensor, ...], q: int, n: int, bias: torch.Tensor | None,
                typed: bool) -> torch.Tensor:
    """:func:`cpu_rows_linear`, through the op only while tracing (see the module doc)."""
    if tracing():
        return cpu_rows_linear(x, w_copy, types, *tables, q, n, bias, typed)
    mod = _kernel()
    fn = mod.typed_rows_forward if typed else mod.fused_rows_forward
    return fn(x, w_copy, types, *tables, q, bias)


def dense_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`cpu_dense_rows`, through the op only while tracing."""
    if tracing():
        return cpu_dense_rows(x, w, bias)
    return _kernel().dense_rows_forward(x, w, bias)


def swiglu_rows(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                types: torch.Tensor, tables: list[torch.Tensor], q: int,
                typed: bool) -> torch.Tensor:
    """:func:`cpu_swiglu_rows`, through the op only while tracing."""
    if tracing():
        return cpu_swiglu_rows(x, gate, up, down, types, tables, q, typed)
    return _kernel().swiglu_rows_forward(x, gate, up, down, types, *tables, q, typed)
