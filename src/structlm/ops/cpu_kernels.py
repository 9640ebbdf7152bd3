"""A compiled CPU kernel for few-row products (cached decode): ``fused-rows``.

At ``M = 1`` every extra GEMM call costs ~25 µs of fixed overhead on 2 threads, so
the pure-PyTorch layouts (1 + runs calls, or a few rectangles) cannot turn the
support's smaller weight reads into time. ``fused-rows`` does the whole projection in
one call: parallel over output rows, each row's dot products run over exactly the
input-column segments its type uses (``csrc/fused_rows.cpp``).

The extension is built once on first use with :func:`torch.utils.cpp_extension.load`
(a C++ compiler is needed; the build lands in ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``). Without a compiler, or with ``STRUCTLM_CPU_KERNELS=0``,
:func:`fused_rows_available` is false and the blocked backend keeps its pure-PyTorch
layouts (a warning says why, once).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from types import ModuleType

import torch

from .partition import TypePartition
from .plan import BlockPlan

__all__ = [
    "FUSED_ROWS_DTYPES",
    "fused_rows_available",
    "fused_rows_linear",
    "fused_rows_macs",
    "segment_tables",
]

#: dtypes the kernel is compiled for (others fall back to the PyTorch layouts).
FUSED_ROWS_DTYPES = (torch.float32, torch.float64)
_SOURCE = Path(__file__).parent / "csrc" / "fused_rows.cpp"
_FLAGS = ["-O3", "-march=native"]
_STATE: dict[str, ModuleType | None] = {}


def _build() -> ModuleType | None:
    if os.environ.get("STRUCTLM_CPU_KERNELS", "1") == "0":
        return None
    from torch.utils import cpp_extension

    digest = hashlib.sha1(_SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:10]
    try:
        return cpp_extension.load(
            name=f"structlm_fused_rows_{digest}", sources=[str(_SOURCE)],
            extra_cflags=_FLAGS, verbose=False,
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


def segment_tables(plan: BlockPlan) -> tuple[torch.Tensor, ...]:
    """The plan's support as CSR tables for the kernel (cached on the plan).

    Returns ``(out_group, seg_ptr, seg_lo, seg_hi)``: ``out_group[n]`` is the output
    group of weight row ``n``; for type ``a`` and output group ``d`` the input
    columns read are ``seg_lo[s] : seg_hi[s]`` for ``s`` in
    ``seg_ptr[a*q + d] : seg_ptr[a*q + d + 1]`` (adjacent groups merged into one segment).
    """
    cached = plan.__dict__.get("_segment_tables")
    if cached is not None:
        return cached
    q, io, oo = plan.q, plan.in_offsets, plan.out_offsets
    out_group = torch.repeat_interleave(
        torch.arange(q, dtype=torch.int32), torch.tensor([oo[d + 1] - oo[d] for d in range(q)])
    )
    ptr, lo, hi = [0], [], []
    for rects in plan.type_rects:
        for d in range(q):
            groups = sorted(b for d0, d1, b0, b1 in rects if d0 <= d < d1 for b in range(b0, b1))
            segs: list[list[int]] = []
            for b in groups:
                if segs and segs[-1][1] == io[b]:
                    segs[-1][1] = io[b + 1]
                else:
                    segs.append([io[b], io[b + 1]])
            lo.extend(s[0] for s in segs)
            hi.extend(s[1] for s in segs)
            ptr.append(len(lo))
    tables = (out_group, torch.tensor(ptr, dtype=torch.int64),
              torch.tensor(lo, dtype=torch.int64), torch.tensor(hi, dtype=torch.int64))
    plan.__dict__["_segment_tables"] = tables
    return tables


def fused_rows_macs(plan: BlockPlan, part: TypePartition) -> int:
    """Multiply-adds the kernel performs for ``part``'s rows: its loop bounds, summed."""
    out_group, ptr, lo, hi = segment_tables(plan)
    q = plan.q
    seg_len = (hi - lo).tolist()
    group_rows = torch.bincount(out_group.long(), minlength=q).tolist()
    total = 0
    for a, count in enumerate(part.counts):
        for d in range(q):
            cell = a * q + d
            total += count * group_rows[d] * sum(seg_len[ptr[cell]:ptr[cell + 1]])
    return total


def fused_rows_linear(x: torch.Tensor, w: torch.Tensor, plan: BlockPlan,
                      part: TypePartition) -> torch.Tensor:
    """``(M, K) -> (M, N)``: ``y = x W_eff(type)^T`` in one compiled call (CPU, no autograd).

    Raises:
        RuntimeError: when the kernel is not available (see :func:`fused_rows_available`).
    """
    mod = _module()
    if mod is None:
        raise RuntimeError("the CPU fused-rows kernel is not available (see the warning above)")
    types = part.types if part.types.dtype == torch.int64 else part.types.long()
    return mod.fused_rows_forward(x, w, types, *segment_tables(plan), plan.q)
