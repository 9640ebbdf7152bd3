"""A compiled CPU kernel for few-row products (cached decode): ``fused-rows``.

The same kernel with the trivial support (one group) is the dense few-row GEMV
(:func:`dense_rows_linear`, used by :class:`~structlm.nn.DecodeLinear`), so the dense
and the algebra layers of a decode step run on one kernel: on this project's 2-core
machine PyTorch's own GEMV (MKL) streams weights at ~9 GB/s, the kernel at ~16 GB/s,
and comparing an algebra layer on the kernel with a dense layer on MKL would credit
the algebra with the kernel's advantage.

At ``M = 1`` every extra GEMM call costs ~25 µs of fixed overhead on 2 threads, so
the pure-PyTorch layouts (1 + runs calls, or a few rectangles) cannot turn the
support's smaller weight reads into time. ``fused-rows`` does the whole projection in
one call (``csrc/fused_rows.cpp``): parallel over output rows, streaming block by block
through exactly the blocks the rows' types use, in a block-contiguous copy of the weight
(:func:`packed_weight`; +1x the layer's weight memory while decoding):
in ``nn.Linear``'s row-major layout a type's blocks are 192-float pieces of each row,
and reading them costs as much memory traffic as the full rows (measured: 36 paper-110m
FFN projections at ``M = 1`` took 24 ms for Q2^2's 9/16 of the bytes vs 20 ms for all).

The extension is built once on first use with :func:`torch.utils.cpp_extension.load`
(a C++ compiler is needed, about a minute on 2 cores; the build lands in
``$TORCH_EXTENSIONS_DIR/structlm/``, by default ``~/.cache/torch_extensions/structlm/``).
Without a compiler, or with ``STRUCTLM_CPU_KERNELS=0``, :func:`fused_rows_available`
is false and the blocked backend keeps its pure-PyTorch layouts (a warning says why,
once).
"""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from .partition import TypePartition
from .plan import BlockPlan

__all__ = [
    "FUSED_ROWS_DTYPES",
    "block_tables",
    "dense_rows_linear",
    "fused_rows_available",
    "fused_rows_linear",
    "fused_rows_macs",
    "pack_blocks",
    "packed_weight",
    "rows_kernel_applies",
    "swiglu_rows",
]

#: dtypes the kernel is compiled for (others fall back to the PyTorch layouts).
FUSED_ROWS_DTYPES = (torch.float32, torch.float64)
_SOURCE = Path(__file__).parent / "csrc" / "fused_rows.cpp"
#: -fopenmp matters: without it ATen's parallel_for runs serially inside an extension
_FLAGS = ["-O3", "-march=native", "-fopenmp"]
_STATE: dict[str, ModuleType | None] = {}
#: a build lock older than this is left over from an interrupted build
_STALE_LOCK_S = 900


def _build_directory(name: str) -> Path:
    """``$TORCH_EXTENSIONS_DIR/structlm/NAME`` (default ``~/.cache/torch_extensions``),
    with a stale lock from an interrupted build removed (torch would wait on it forever)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR")
                or Path.home() / ".cache" / "torch_extensions")
    path = root / "structlm" / name
    path.mkdir(parents=True, exist_ok=True)
    lock = path / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    return path


def _build() -> ModuleType | None:
    if os.environ.get("STRUCTLM_CPU_KERNELS", "1") == "0":
        return None
    from torch.utils import cpp_extension

    digest = hashlib.sha1(_SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:10]
    name = f"structlm_fused_rows_{digest}"
    try:
        return cpp_extension.load(
            name=name, sources=[str(_SOURCE)], extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"], verbose=False,
            build_directory=str(_build_directory(name)),
        )
    except Exception as exc:  # no compiler, no ninja, unsupported flags: fall back
        warnings.warn(
            f"structlm: could not build the CPU fused-rows kernel ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}); decode "
            "uses the pure-PyTorch layouts instead. Set STRUCTLM_CPU_KERNELS=0 to skip "
            "the build.",
            RuntimeWarning, stacklevel=3,
        )
        return None


def _module() -> ModuleType | None:
    if "mod" not in _STATE:
        _STATE["mod"] = _build()
    return _STATE["mod"]


def fused_rows_available() -> bool:
    """Whether the compiled kernel is usable (builds it on the first call)."""
    return _module() is not None


def rows_kernel_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a few-row product of ``x`` and ``w`` can run on the kernel: CPU, float32 /
    float64, no autograd graph to record, not traced or compiled, the kernel built.

    Cheap enough to call on every layer call (a handful of attribute reads); the row
    count is the caller's to check.
    """
    return (x.device.type == "cpu" and x.dtype in FUSED_ROWS_DTYPES and w.dtype == x.dtype
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and w.is_contiguous() and fused_rows_available())


def block_tables(plan: BlockPlan) -> tuple[torch.Tensor, ...]:
    """The plan's support as tables for the kernel (cached on the plan).

    Returns ``(out_off, in_off, blk_off, uses)``: the output and input group offsets;
    block ``(d, b)`` of the packed weight starts at ``blk_off[d*q + b]``; ``uses[a, d, b]``
    (uint8) says whether type ``a`` reads block ``(d, b)`` (output group ``d``, input
    group ``b``).
    """
    cached = plan.__dict__.get("_block_tables")
    if cached is not None:
        return cached
    q, io, oo = plan.q, plan.in_offsets, plan.out_offsets
    blk_off, pos = [], 0
    for d in range(q):
        for b in range(q):
            blk_off.append(pos)
            pos += (oo[d + 1] - oo[d]) * (io[b + 1] - io[b])
    uses = torch.from_numpy(np.ascontiguousarray(plan.type_blocks.transpose(0, 2, 1), np.uint8))
    tables = (torch.tensor(oo, dtype=torch.int64), torch.tensor(io, dtype=torch.int64),
              torch.tensor(blk_off, dtype=torch.int64), uses)
    plan.__dict__["_block_tables"] = tables
    return tables


def dense_tables(n: int, k: int) -> tuple[torch.Tensor, ...]:
    """The trivial support's tables (one group, one block) for an ``(n, k)`` weight."""
    key = (n, k)
    if key not in _DENSE_TABLES:
        _DENSE_TABLES[key] = (torch.tensor([0, n]), torch.tensor([0, k]), torch.tensor([0]),
                              torch.ones(1, 1, 1, dtype=torch.uint8))
    return _DENSE_TABLES[key]


_DENSE_TABLES: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}


def pack_blocks(w: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """``(N, K)`` weight -> 1-D copy, block ``(d, b)`` after block, each row-major."""
    io, oo = plan.in_offsets, plan.out_offsets
    return torch.cat([w[oo[d]:oo[d + 1], io[b]:io[b + 1]].reshape(-1)
                      for d in range(plan.q) for b in range(plan.q)])


#: weight tensor -> (its version when packed, the packed copy); entries die with the weight
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def packed_weight(w: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """The block-contiguous copy of ``w`` the kernel reads (one extra copy of the weight
    per layer, made on first use and redone after any in-place update of ``w``)."""
    entry = _PACKED.get(w)
    if entry is None or entry[0] != w._version:
        entry = (w._version, pack_blocks(w.detach(), plan))
        _PACKED[w] = entry
    return entry[1]


def fused_rows_macs(plan: BlockPlan, part: TypePartition) -> int:
    """Multiply-adds the kernel performs for ``part``'s rows: its loop bounds, summed."""
    oo, io, _, uses = block_tables(plan)
    block_macs = torch.outer(oo.diff(), io.diff())  # (d, b): rows x width
    counts = torch.tensor(part.counts, dtype=torch.int64)
    return int((counts[:, None, None] * uses.long() * block_macs).sum())


def _kernel_for(x: torch.Tensor, w: torch.Tensor) -> ModuleType:
    """The compiled module, after the checks every entry point shares."""
    mod = _module()
    if mod is None:
        raise RuntimeError("the CPU fused-rows kernel is not available (see the warning above)")
    if x.dtype != w.dtype:
        raise TypeError(f"x has dtype {x.dtype} but the weight has {w.dtype}")
    return mod


def fused_rows_linear(x: torch.Tensor, w: torch.Tensor, plan: BlockPlan,
                      part: TypePartition, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(M, K) -> (M, N)``: ``y = x W_eff(type)^T (+ bias)`` in one compiled call (CPU,
    no autograd).

    Reads a block-contiguous copy of ``w`` (:func:`packed_weight`).

    Raises:
        RuntimeError: when the kernel is not available (see :func:`fused_rows_available`).
    """
    mod = _kernel_for(x, w)
    if x.shape[-1] != plan.in_features or tuple(w.shape) != (plan.out_features, plan.in_features):
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(w.shape)} do not fit the plan "
                         f"(in {plan.in_features}, out {plan.out_features})")
    types = part.types if part.types.dtype == torch.int64 else part.types.long()
    return mod.fused_rows_forward(x, packed_weight(w, plan), types, *block_tables(plan),
                                  plan.q, bias)


def dense_rows_linear(x: torch.Tensor, w: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(M, K) -> (M, N)``: ``y = x W^T (+ bias)`` for a few rows on the same kernel
    (one group, one block: ``w`` is read in place, no copy). CPU, no autograd.

    Raises:
        RuntimeError: when the kernel is not available (see :func:`fused_rows_available`).
    """
    mod = _kernel_for(x, w)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(w.shape)} do not fit: "
                         "expected x (M, K) and weight (N, K)")
    return mod.dense_rows_forward(x, w.contiguous(), bias)


def swiglu_rows(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                plans: tuple[BlockPlan, BlockPlan] | None = None,
                part: TypePartition | None = None) -> torch.Tensor:
    """``(M, D) -> (M, D)``: ``down(silu(gate(x)) * up(x))`` for a few rows in one compiled
    call (CPU, no autograd): the decode FFN, one Python call per layer instead of five.

    ``plans = (gate/up plan, down plan)`` and ``part`` for algebra projections (their
    block-contiguous copies are read); ``None`` for a dense FFN (weights read in place,
    the same loop with one group).
    """
    mod = _kernel_for(x, gate)
    if plans is None:
        types = torch.zeros(x.shape[0], dtype=torch.int64)
        return mod.swiglu_rows_forward(x, gate, up, down, types,
                                       *dense_tables(*gate.shape), *dense_tables(*down.shape), 1)
    if part is None:
        raise ValueError("algebra projections need the rows' TypePartition")
    gu, dn = plans
    types = part.types if part.types.dtype == torch.int64 else part.types.long()
    return mod.swiglu_rows_forward(x, packed_weight(gate, gu), packed_weight(up, gu),
                                   packed_weight(down, dn), types, *block_tables(gu),
                                   *block_tables(dn), gu.q)
