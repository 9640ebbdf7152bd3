"""Launchers: check shapes, allocate, launch (no host synchronisation on CUDA)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton

from structlm.ops.triton.kernels import (
    next_power_of_2,
    support_decode_kernel,
    support_dw_kernel,
    support_matmul_kernel,
)
from structlm.ops.triton.tables import SupportTables
from structlm.settings import triton_interpret

__all__ = [
    "TileConfig",
    "device_segments",
    "launch_dw",
    "launch_dx",
    "launch_forward",
]

def _interpreting() -> bool:
    return triton_interpret()


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of one launch."""

    bm: int = 64
    bn: int = 64
    bk: int = 32
    num_warps: int = 4
    num_stages: int = 3


def default_config(m: int, device: torch.device) -> TileConfig:
    """Tile sizes for ``m`` rows (small tiles under the CPU interpreter)."""
    if _interpreting() or device.type != "cuda":
        return TileConfig(bm=32, bn=64, bk=32, num_warps=1, num_stages=1)
    if m <= 64:
        return TileConfig(bm=16, bn=128, bk=64, num_warps=4, num_stages=4)
    return TileConfig(bm=64, bn=128, bk=32, num_warps=4, num_stages=3)


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _flags(dtype: torch.dtype) -> dict[str, bool]:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the triton backend supports {SUPPORTED_DTYPES}, got {dtype}; "
                        "use backend='blocked' for float64")
    return {"UPCAST": _interpreting() and dtype != torch.float32,
            "IEEE": dtype == torch.float32}


def device_segments(types: torch.Tensor, q: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``perm`` (rows grouped by type), per-type ``start`` and ``count`` — int32, on
    the types' device, without a host synchronisation."""
    t = types.reshape(-1).long()
    counts = torch.zeros(q, dtype=torch.int64, device=t.device)
    counts.scatter_add_(0, t, torch.ones_like(t))
    perm = torch.argsort(t, stable=True).to(torch.int32)
    start = torch.cumsum(counts, 0) - counts
    return perm, start.to(torch.int32), counts.to(torch.int32)


#: Tile configurations tried by the autotuner on a GPU (keyed on M, N, K).
AUTOTUNE_CONFIGS = [
    TileConfig(bm, bn, bk, w, s)
    for bm, bn, bk, w, s in [(16, 64, 64, 4, 4), (32, 64, 64, 4, 4), (64, 64, 32, 4, 4),
                             (64, 128, 32, 4, 3), (128, 128, 32, 8, 3), (128, 64, 64, 4, 3)]
]


@functools.cache
def _tuned_matmul(accumulate: bool) -> Any:
    """The matmul kernel under ``triton.autotune`` (GPU only); an accumulating launch
    restores its output between trial runs."""
    configs = [triton.Config({"BM": c.bm, "BN": c.bn, "BK": c.bk}, num_warps=c.num_warps,
                             num_stages=c.num_stages) for c in AUTOTUNE_CONFIGS]
    return triton.autotune(configs=configs, key=["M_KEY", "N_KEY", "K_KEY"],
                           restore_value=["out_ptr"] if accumulate else [])(
        support_matmul_kernel)


def _matmul(a: torch.Tensor, w_strides: tuple[int, int], w: torch.Tensor, out: torch.Tensor,
            perm: torch.Tensor, start: torch.Tensor, count: torch.Tensor, sup: torch.Tensor,
            src: torch.Tensor, cnt: torch.Tensor, red_off: torch.Tensor, col_off: torch.Tensor,
            q: int, accumulate: bool, cfg: TileConfig | None) -> None:
    nseg = int(start.numel())
    m, n_out = a.shape[0], out.shape[1]
    args = (a, w, out, perm, start, count, sup, nseg, src, cnt, red_off, col_off, q,
            a.stride(0), a.stride(1), w_strides[0], w_strides[1], out.stride(0), out.stride(1),
            m, n_out, a.shape[1])
    consts = {"MAXSRC": src.shape[-1], "NSEG_P2": next_power_of_2(nseg),
              "Q_P2": next_power_of_2(q), "ACCUMULATE": accumulate, **_flags(a.dtype)}

    def grid(meta: dict[str, int]) -> tuple[int, int]:
        return (triton.cdiv(m, meta["BM"]) + nseg, triton.cdiv(n_out, meta["BN"]) + q)

    if cfg is None and a.device.type == "cuda" and not _interpreting():
        _tuned_matmul(accumulate)[grid](*args, **consts)
        return
    cfg = cfg or default_config(m, a.device)
    support_matmul_kernel[grid](*args, **consts, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk,
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def launch_forward(x: torch.Tensor, weight: torch.Tensor, types: torch.Tensor,
                   tables: SupportTables, mode: str = "fused",
                   cfg: TileConfig | None = None) -> torch.Tensor:
    """``y (M, N)`` for ``x (M, K)``, ``weight (N, K)``, ``types (M,)``.

    ``mode``: ``"fused"`` (one launch, all source blocks in one accumulator),
    ``"two-stage"`` (common blocks for all rows, then each type's extra blocks
    accumulated), or ``"decode"`` (vector reduction, for a handful of rows).
    """
    m, n, q = x.shape[0], weight.shape[0], tables.q
    _flags(x.dtype)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    w_strides = (weight.stride(1), weight.stride(0))  # w[k, n] = weight[n, k]
    if mode == "decode":
        dc = cfg or (default_config(m, x.device) if _interpreting() or x.device.type != "cuda"
                     else TileConfig(bm=1, bn=64, bk=128, num_warps=4, num_stages=2))
        support_decode_kernel[(m, triton.cdiv(n, dc.bn) + q)](
            x, weight, y, types, tables.fwd_src, tables.fwd_cnt, tables.in_off, tables.out_off,
            q, x.stride(0), x.stride(1), w_strides[0], w_strides[1], y.stride(0), y.stride(1),
            MAXSRC=tables.fwd_src.shape[-1], Q_P2=next_power_of_2(q), BN=dc.bn, BK=dc.bk,
            num_warps=dc.num_warps, num_stages=dc.num_stages)
        return y
    perm, start, count = device_segments(types, q)
    if mode == "fused":
        sup = torch.arange(q, dtype=torch.int32, device=x.device)
        _matmul(x, w_strides, weight, y, perm, start, count, sup, tables.fwd_src,
                tables.fwd_cnt, tables.in_off, tables.out_off, q, False, cfg)
    elif mode == "two-stage":
        zero = torch.zeros(1, dtype=torch.int32, device=x.device)
        total = torch.full((1,), m, dtype=torch.int32, device=x.device)
        _matmul(x, w_strides, weight, y, perm, zero, total, zero, tables.common_src,
                tables.common_cnt, tables.in_off, tables.out_off, q, False, cfg)
        sup = torch.arange(q, dtype=torch.int32, device=x.device)
        _matmul(x, w_strides, weight, y, perm, start, count, sup, tables.extra_src,
                tables.extra_cnt, tables.in_off, tables.out_off, q, True, cfg)
    else:
        raise ValueError(f"unknown mode {mode!r}: expected 'fused', 'two-stage' or 'decode'")
    return y


def launch_dx(gy: torch.Tensor, weight: torch.Tensor, types: torch.Tensor,
              tables: SupportTables, cfg: TileConfig | None = None) -> torch.Tensor:
    """``dX (M, K)``: the transposed support, ``dX[:, beta] = sum_delta gy[:, delta] W``."""
    m, k, q = gy.shape[0], weight.shape[1], tables.q
    dx = torch.empty(m, k, device=gy.device, dtype=gy.dtype)
    if m == 0:
        return dx
    perm, start, count = device_segments(types, q)
    sup = torch.arange(q, dtype=torch.int32, device=gy.device)
    _matmul(gy, (weight.stride(0), weight.stride(1)), weight, dx, perm, start, count, sup,
            tables.bwd_dst, tables.bwd_cnt, tables.out_off, tables.in_off, q, False, cfg)
    return dx


def launch_dw(gy: torch.Tensor, x: torch.Tensor, types: torch.Tensor, tables: SupportTables,
              weight_shape: tuple[int, int], cfg: TileConfig | None = None) -> torch.Tensor:
    """``dW (N, K)``: each used block reduces over the rows of the types using it;
    blocks no type uses are zero."""
    q = tables.q
    alloc = torch.zeros if tables.has_dead_blocks else torch.empty
    dw = alloc(weight_shape, device=gy.device, dtype=gy.dtype)
    cfg = cfg or default_config(gy.shape[0], gy.device)
    bn = bk = max(16, min(cfg.bn, 64))
    if gy.shape[0] == 0:
        return dw.zero_()
    perm, start, count = device_segments(types, q)
    tiles = tables.dw_tiles(bn, bk)
    support_dw_kernel[(int(tiles.shape[0]),)](
        gy, x, dw, perm, start, count, tables.blk_beta, tables.blk_delta, tables.blk_types,
        tables.blk_ntypes, tables.in_off, tables.out_off, tiles,
        gy.stride(0), gy.stride(1), x.stride(0), x.stride(1), dw.stride(0), dw.stride(1),
        MAXT=tables.blk_types.shape[-1], **_flags(gy.dtype), BM=max(16, cfg.bm),
        BN=bn, BK=bk, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dw
