"""Compiled CPU kernels for few-row products (cached decode): ``fused-rows``.

The same kernel with the trivial support (one group) is the dense few-row GEMV
(:func:`dense_rows_linear`, used by :class:`~structlm.nn.DecodeLinear`), so the dense
and the algebra layers of a decode step run on one kernel: on this project's 2-core
machine PyTorch's own GEMV (MKL) streams weights at ~9 GB/s, the kernel at ~16 GB/s,
and comparing an algebra layer on the kernel with a dense layer on MKL would credit
the algebra with the kernel's advantage.

At ``M = 1`` every extra GEMM call costs ~25 µs of fixed overhead on 2 threads, so
the pure-PyTorch layouts (1 + runs calls, or a few rectangles) cannot turn the
support's smaller weight reads into time. ``fused-rows`` does the whole projection in
one call (``csrc/fused_rows.cpp``), reading exactly the support's weight from a copy
laid out for it: in ``nn.Linear``'s row-major layout a type's blocks are 192-float
pieces of each row, and reading them costs as much memory traffic as the full rows
(measured: 36 paper-110m FFN projections at ``M = 1`` took 24 ms for Q2^2's 9/16 of
the bytes vs 20 ms for all). Two copies (:func:`decode_copy` picks):

* ``"typed"`` (default): one copy per type holding just the blocks it reads, each row's
  blocks back to back (:func:`typed_weight`; memory: the sum of the types' supports,
  2.25x the layer's weight for Q2^2, 1.75x for Q4). When every row has one type (a
  decode step), the type's weight is one contiguous stream, read like a dense GEMV's;
  the dense layers are this loop's ``q = 1`` case. Measured on 36 paper-110m FFN
  projections at ``M = 1``: ~5% faster than the old block-packed copy (about 1% of a
  decode step).
* ``"blocks"``: one panel-packed copy (:func:`packed_weight`; +1x the weight), the
  rows' types selecting blocks; also what rows of mixed types always use.

The LM's decode step runs every decoder block in one call on these kernels
(:func:`decode_stack`, ``csrc/decode_block.cpp``: layer norms, attention over the KV
cache, all projections), see :mod:`structlm.models.decode_step`.

The extension is built once on first use with :func:`torch.utils.cpp_extension.load`
(a C++ compiler is needed, about a minute on 2 cores; the build lands in
``$TORCH_EXTENSIONS_DIR/structlm/``, by default ``~/.cache/torch_extensions/structlm/``).
Without a compiler, or with ``STRUCTLM_CPU_KERNELS=0``, :func:`fused_rows_available`
is false and the blocked backend keeps its pure-PyTorch layouts (a warning says why,
once).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from structlm.ops import cpu_ops
from structlm.ops.cpu_extension import extension
from structlm.ops.partition import TypePartition
from structlm.ops.plan import BlockPlan
from structlm.ops.route_table import THRESHOLDS
from structlm.settings import decode_copy_default

#: one-type batches read the typed copies up to this many rows per type
_TYPED_MAX_PER_TYPE = THRESHOLDS["kernel_portable_max_rows_per_type"].value

__all__ = [
    "DECODE_COPIES",
    "DECODE_COPY",
    "PANEL_ROWS",
    "block_tables",
    "decode_copy",
    "decode_copy_mode",
    "dense_packed_weight",
    "dense_rows_binding",
    "dense_rows_linear",
    "ffn_kernel_args",
    "fused_rows_available",
    "fused_rows_linear",
    "fused_rows_macs",
    "kernel_for",
    "pack_blocks",
    "pack_types",
    "packed_weight",
    "swiglu_rows",
    "typed_rows_binding",
    "typed_weight",
    "uses_typed_copy",
]

#: the weight copies :func:`decode_copy` can choose
DECODE_COPIES = ("typed", "blocks")
def fused_rows_available() -> bool:
    """Whether the compiled kernel is usable (builds it on the first call)."""
    return extension() is not None


def block_tables(plan: BlockPlan) -> tuple[torch.Tensor, ...]:
    """The plan's support as tables for the kernel (cached on the plan).

    Returns ``(out_off, in_off, uses)``: the output and input group offsets, and
    ``uses[a, d, b]`` (uint8), whether type ``a`` reads block ``(d, b)`` (output group
    ``d``, input group ``b``).
    """
    cached = plan.__dict__.get("_block_tables")
    if cached is not None:
        return cached
    uses = torch.from_numpy(np.ascontiguousarray(plan.type_blocks.transpose(0, 2, 1), np.uint8))
    tables = (torch.tensor(plan.out_offsets, dtype=torch.int64),
              torch.tensor(plan.in_offsets, dtype=torch.int64), uses)
    plan.__dict__["_block_tables"] = tables
    return tables


def dense_tables(n: int, k: int) -> tuple[torch.Tensor, ...]:
    """The trivial support's tables (one group, one block) for an ``(n, k)`` weight."""
    key = (n, k)
    if key not in _DENSE_TABLES:
        _DENSE_TABLES[key] = (torch.tensor([0, n]), torch.tensor([0, k]),
                              torch.ones(1, 1, 1, dtype=torch.uint8))
    return _DENSE_TABLES[key]


_DENSE_TABLES: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}


#: Output rows of a strip of the panel-packed copy (``csrc/panel.h``'s ``kPanel``).
PANEL_ROWS = 16


def pack_blocks(w: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """``(N, K)`` weight -> 1-D panel-packed copy: each output group's rows cut into
    strips of ``PANEL_ROWS`` (the last one the rows left over), each strip stored
    transposed — the strip of ``pw`` rows from row ``n0`` is ``W[n0:n0 + pw, :]^T``,
    ``(K, pw)`` row-major at element ``n0 * K`` — so block ``(d, b)``'s panel of a strip
    is its rows ``in_off[b]:in_off[b + 1]`` and the kernel broadcasts each input against
    ``pw`` contiguous weights, reading the strips front to back."""
    return _strips(w, plan.out_offsets)


def _strips(w: torch.Tensor, out_offsets: tuple[int, ...]) -> torch.Tensor:
    """``(N, K)`` -> the strips of :func:`pack_blocks` within each output group."""
    oo = out_offsets
    return torch.cat([w[n0:min(n0 + PANEL_ROWS, oo[d + 1])].t().reshape(-1)
                      for d in range(len(oo) - 1) for n0 in range(oo[d], oo[d + 1], PANEL_ROWS)])


def _cached_copy(cache: WeakIdKeyDictionary, w: torch.Tensor, plan: BlockPlan | None,
                 pack: Callable[[torch.Tensor, BlockPlan | None], torch.Tensor]
                 ) -> torch.Tensor:
    """``pack(w, plan)``, kept in ``cache`` (entries die with the weight) and redone when
    ``w``'s version (in-place updates) or data pointer (``.data`` swaps and ``.to()``,
    which keep the version) changed."""
    state = (w._version, w.data_ptr())
    entry = cache.get(w)
    if entry is None or entry[0] != state:
        entry = (state, pack(w.detach(), plan))
        cache[w] = entry
    return entry[1]


#: weight tensor -> (its state when packed, the packed copy)
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def packed_weight(w: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """The panel-packed copy of ``w`` (:func:`pack_blocks`) the kernel reads (one extra
    copy of the weight per layer, made on first use and redone after any in-place update
    or ``.data`` swap of ``w``)."""
    return _cached_copy(_PACKED, w, plan, pack_blocks)


def pack_types(w: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """``(N, K)`` weight -> 1-D typed copies, type after type: in type ``a``'s, output
    group ``d``'s rows hold the blocks ``(d, b)`` that ``a`` reads, ascending ``b``, back
    to back (row-major ``(rows of d, their total width)``)."""
    io, oo = plan.in_offsets, plan.out_offsets
    uses = block_tables(plan)[2]
    parts = []
    for a in range(uses.shape[0]):
        for d in range(plan.q):
            cols = [w[oo[d]:oo[d + 1], io[b]:io[b + 1]] for b in range(plan.q) if uses[a, d, b]]
            if cols:
                parts.append(torch.cat(cols, dim=1).reshape(-1))
    return torch.cat(parts) if parts else w.new_empty(0)


def typed_copy_sizes(plan: BlockPlan) -> list[int]:
    """Elements of each type's copy in :func:`pack_types` (type after type): the sum over
    output groups of their rows times the widths of the blocks the type reads."""
    oo, io, uses = block_tables(plan)
    lengths = uses.long() @ io.diff()  # (types, q): row length of each output group
    return (lengths @ oo.diff()).tolist()


#: weight tensor -> (its state when copied, the typed copies)
_TYPED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def typed_weight(w: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """The typed copies of ``w`` (:func:`pack_types`), made on first use and redone after
    any in-place update or ``.data`` swap of ``w``."""
    return _cached_copy(_TYPED, w, plan, pack_types)


_DECODE_COPY = [decode_copy_default()]
#: the decode-copy stack (its last item is :func:`decode_copy_mode`), for the bound calls'
#: check, which reads it without a call
DECODE_COPY = _DECODE_COPY


@contextlib.contextmanager
def decode_copy(mode: str) -> Iterator[None]:
    """Within the block, single-type few-row products read the weight copy ``mode``:
    ``"typed"`` (the default; the environment variable ``STRUCTLM_DECODE_COPY`` sets it
    for the process) or ``"blocks"`` (less memory, slower; see the module docstring)."""
    if mode not in DECODE_COPIES:
        raise ValueError(f"unknown decode copy {mode!r}: expected one of {DECODE_COPIES}")
    _DECODE_COPY.append(mode)
    try:
        yield
    finally:
        _DECODE_COPY.pop()


def decode_copy_mode() -> str:
    """The weight copy single-type few-row products read now (see :func:`decode_copy`)."""
    mode = _DECODE_COPY[-1]
    if mode not in DECODE_COPIES:
        raise ValueError(f"STRUCTLM_DECODE_COPY={mode!r}: expected one of {DECODE_COPIES}")
    return mode


def uses_typed_copy(part: TypePartition | None) -> bool:
    """Whether rows with these types read the typed copies: all of one type, at most
    ``kernel_portable_max_rows_per_type × q`` rows (the typed loop streams the inputs once
    per output row: a decode step's few rows) and the ``"typed"`` copy chosen (a dense
    layer, ``part=None``, always does)."""
    return part is None or (decode_copy_mode() == "typed" and len(part.present) <= 1
                            and sum(part.counts) <= _TYPED_MAX_PER_TYPE * len(part.counts))


def fused_rows_macs(plan: BlockPlan, part: TypePartition) -> int:
    """Multiply-adds the kernel performs for ``part``'s rows: its loop bounds, summed."""
    oo, io, uses = block_tables(plan)
    block_macs = torch.outer(oo.diff(), io.diff())  # (d, b): rows x width
    counts = torch.tensor(part.counts, dtype=torch.int64)
    return int((counts[:, None, None] * uses.long() * block_macs).sum())


def kernel_for(x: torch.Tensor, w: torch.Tensor) -> ModuleType:
    """The compiled module, after the checks every entry point shares."""
    mod = extension()
    if mod is None:
        raise RuntimeError("the CPU fused-rows kernel is not available (see the warning above)")
    if x.dtype != w.dtype:
        raise TypeError(f"x has dtype {x.dtype} but the weight has {w.dtype}")
    return mod


def fused_rows_linear(x: torch.Tensor, w: torch.Tensor, plan: BlockPlan,
                      part: TypePartition, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(M, K) -> (M, N)``: ``y = x W_eff(type)^T (+ bias)`` in one compiled call (CPU,
    no autograd).

    Reads the typed copies of ``w`` when every row has one type (:func:`uses_typed_copy`),
    else its panel-packed copy (:func:`packed_weight`).

    Raises:
        RuntimeError: when the kernel is not available (see :func:`fused_rows_available`).
    """
    mod = kernel_for(x, w)
    if x.shape[-1] != plan.in_features or tuple(w.shape) != (plan.out_features, plan.in_features):
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(w.shape)} do not fit the plan "
                         f"(in {plan.in_features}, out {plan.out_features})")
    del mod  # checked: built, dtypes agree
    typed = uses_typed_copy(part)
    copy = typed_weight(w, plan) if typed else packed_weight(w, plan)
    return cpu_ops.rows_linear(x, copy, _row_types(x, part), block_tables(plan), plan.q,
                               plan.out_features, bias, typed)


def typed_rows_binding(w: torch.Tensor, plan: BlockPlan, max_rows: int) -> object:
    """The layer's few-row product of one type bound once (the compiled
    ``TypedRowsBinding``): ``binding(x, types, w, bias)`` returns ``y (*, N)`` for
    ``x (*, K)`` of at most ``max_rows`` rows that all have one type, or ``None`` where
    it does not apply (another or a changed weight, autograd recording, another dtype
    or device, mixed types): the caller then takes its general path.

    The typed copies (:func:`typed_weight`), the support tables and every type's row
    lengths are fixed at binding time, so a decode call is one crossing into C++ whose
    checks are a few integer compares (the unbound path's Python gate and wrapper cost
    ~0.5 ms a call with cold caches, see ``csrc/bindings.cpp``).

    Raises:
        RuntimeError: when the kernel is not available (see :func:`fused_rows_available`).
    """
    mod = kernel_for(w, w)
    oo, io, uses = block_tables(plan)
    return mod.TypedRowsBinding(w, typed_weight(w, plan), oo, io,
                                uses, plan.q, max_rows)


def dense_rows_binding(w: torch.Tensor, max_rows: int) -> object:
    """:func:`typed_rows_binding` for a dense ``(N, K)`` weight (one type, one group: the
    weight is its own copy, read in place; the call's ``types`` are not read), so a dense
    layer's decode call crosses into C++ as cheaply as an algebra layer's.

    Raises:
        RuntimeError: when the kernel is not available (see :func:`fused_rows_available`).
    """
    mod = kernel_for(w, w)
    oo, io, uses = dense_tables(*w.shape)
    return mod.TypedRowsBinding(w, w, oo, io, uses, 1, max_rows)


#: weight tensor -> (its state when packed, its panel-packed copy)
_DENSE_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def dense_packed_weight(w: torch.Tensor) -> torch.Tensor:
    """The panel-packed copy of a dense ``(N, K)`` weight (one group: strips of
    ``PANEL_ROWS`` rows, each transposed), made on first use and redone after any
    in-place update or ``.data`` swap of ``w``."""
    return _cached_copy(_DENSE_PACKED, w, None, lambda v, _: _strips(v, (0, v.shape[0])))


def dense_rows_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                      packed: bool = False) -> torch.Tensor:
    """``(M, K) -> (M, N)``: ``y = x W^T (+ bias)`` for a few rows on the same kernels as
    the algebra layers (one group, one block): ``w`` read in place, or with ``packed`` its
    panel-packed copy (:func:`dense_packed_weight`; the route picks by the row count,
    ``dense_in_place_max_rows`` in :data:`structlm.ops.route.THRESHOLDS`). CPU, no
    autograd.

    Raises:
        RuntimeError: when the kernel is not available (see :func:`fused_rows_available`).
    """
    mod = kernel_for(x, w)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(w.shape)} do not fit: "
                         "expected x (M, K) and weight (N, K)")
    del mod  # checked: built, dtypes agree
    if packed:
        types = torch.zeros(x.shape[0], dtype=torch.int64)
        return cpu_ops.rows_linear(x, dense_packed_weight(w), types, dense_tables(*w.shape),
                                   1, w.shape[0], bias, False)
    return cpu_ops.dense_rows(x, w.contiguous(), bias)


def ffn_kernel_args(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                    plans: tuple[BlockPlan, BlockPlan] | None = None,
                    typed: bool = True) -> list[torch.Tensor]:
    """The SwiGLU weights and support tables as the kernel takes them: the three weights
    (for algebra projections their typed copies, or with ``typed=False`` their
    panel-packed ones; a dense FFN's weights as they are), then the gate/up tables
    and the down tables (:func:`block_tables`, or the trivial :func:`dense_tables`)."""
    if plans is None:
        return [gate, up, down, *dense_tables(*gate.shape), *dense_tables(*down.shape)]
    gu, dn = plans
    copy = typed_weight if typed else packed_weight
    return [copy(gate, gu), copy(up, gu), copy(down, dn), *block_tables(gu), *block_tables(dn)]


def _row_types(x: torch.Tensor, part: TypePartition | None) -> torch.Tensor:
    if part is None:
        return torch.zeros(x.shape[0], dtype=torch.int64)
    return part.types if part.types.dtype == torch.int64 else part.types.long()


def swiglu_rows(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                plans: tuple[BlockPlan, BlockPlan] | None = None,
                part: TypePartition | None = None) -> torch.Tensor:
    """``(M, D) -> (M, D)``: ``down(silu(gate(x)) * up(x))`` for a few rows in one compiled
    call (CPU, no autograd): the decode FFN, one Python call per layer instead of five.

    ``plans = (gate/up plan, down plan)`` and ``part`` for algebra projections (their
    typed or panel-packed copies are read, see :func:`uses_typed_copy`); ``None`` for
    a dense FFN (weights read in place, the same loop with one group).
    """
    mod = kernel_for(x, gate)
    if plans is not None and part is None:
        raise ValueError("algebra projections need the rows' TypePartition")
    q = 1 if plans is None else plans[0].q
    typed = uses_typed_copy(None if plans is None else part)
    del mod  # checked: built, dtypes agree
    args = ffn_kernel_args(gate, up, down, plans, typed)
    return cpu_ops.swiglu_rows(x, *args[:3], _row_types(x, part), args[3:], q, typed)
