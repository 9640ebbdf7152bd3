"""Triton kernels for the algebra product, driven by support tables.

* ``support_matmul_kernel``: one program computes an output tile for rows of one
  segment (a type, or all rows) and accumulates every source block the support
  allows for that output group into one fp32 accumulator — the **fused** forward
  (both endpoint products ``x_i W_ij + x_j W_jj`` of ``Q_q`` in one accumulator), each
  stage of the **two-stage** forward, and ``dX`` (the transposed support: pass the
  weight with swapped strides and the ``bwd`` tables).
* ``support_decode_kernel``: vector reduction for a handful of rows; reads only the
  weight blocks the row's type needs.
* ``support_dw_kernel``: ``dW`` per used block, reducing over the rows of exactly the
  types that use the block (a grouped GEMM over type segments).

Rows arrive grouped by segment through ``perm`` (a stable argsort of the types), with
per-segment ``start``/``count`` on the device: no host synchronisation; the row-tile
grid is an upper bound (``cdiv(M, BM) + segments``) and idle programs return.
``UPCAST`` converts bf16/fp16 tiles to fp32 before ``tl.dot`` (only under the CPU
interpreter, whose bf16 dot is wrong); on a GPU they go to the tensor cores with fp32
accumulation. ``IEEE`` asks for true fp32 products for fp32 inputs (no TF32), like
torch's default matmul.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["support_decode_kernel", "support_dw_kernel", "support_matmul_kernel"]


@triton.jit
def _segment_of(pid, sizes, idx, BLOCK: tl.constexpr):
    """Which segment tile ``pid`` falls in, when segment ``i`` (of ``sizes[i]``
    items) is cut into tiles of ``BLOCK``; and the tile's index inside it."""
    tiles = (sizes + BLOCK - 1) // BLOCK
    cum = tl.cumsum(tiles, 0)
    seg = tl.sum((cum <= pid).to(tl.int32), 0)
    before = tl.sum(tl.where(idx < seg, tiles, 0), 0)
    return seg, pid - before


@triton.jit
def _dot_acc(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """``acc + a @ b`` in fp32 (IEEE products for fp32 inputs; fp32 tiles under the
    interpreter for bf16/fp16)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _locate_tile(pid_m, seg_count_ptr, num_segs, NSEG_P2: tl.constexpr, BM: tl.constexpr):
    """Segment of row tile ``pid_m`` and the tile's index inside it."""
    segs = tl.arange(0, NSEG_P2)
    cnt = tl.load(seg_count_ptr + segs, mask=segs < num_segs, other=0)
    return _segment_of(pid_m, cnt, segs, BM)


@triton.jit
def _locate_cols(pid_n, col_off_ptr, q, Q_P2: tl.constexpr, BN: tl.constexpr):
    """Output group, first and end column of column tile ``pid_n`` (tiles never
    straddle two groups; ``grp >= q`` means an idle program)."""
    g = tl.arange(0, Q_P2)
    lo = tl.load(col_off_ptr + g, mask=g < q, other=0)
    hi = tl.load(col_off_ptr + g + 1, mask=g < q, other=0)
    grp, local = _segment_of(pid_n, hi - lo, g, BN)
    n0 = tl.load(col_off_ptr + grp, mask=grp < q, other=0) + local * BN
    n1 = tl.load(col_off_ptr + grp + 1, mask=grp < q, other=0)
    return grp, n0, n1


@triton.jit
def support_matmul_kernel(
    a_ptr, w_ptr, out_ptr,
    perm_ptr, seg_start_ptr, seg_count_ptr, seg_sup_ptr, num_segs,
    src_ptr, src_cnt_ptr, red_off_ptr, col_off_ptr, q,
    stride_am, stride_ak, stride_wk, stride_wn, stride_om, stride_on,
    M_KEY, N_KEY, K_KEY,
    MAXSRC: tl.constexpr, NSEG_P2: tl.constexpr, Q_P2: tl.constexpr, ACCUMULATE: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """``out[rows, cols] (+)= sum_{beta in src[sup, grp]} a[rows, red(beta)] @ w[red(beta), cols]``

    (``red(beta)``: the reduction columns of group ``beta``)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    seg, local = _locate_tile(pid_m, seg_count_ptr, num_segs, NSEG_P2, BM)
    if seg >= num_segs:
        return
    grp, n0, n1 = _locate_cols(pid_n, col_off_ptr, q, Q_P2, BN)
    if grp >= q:
        return
    sup = tl.load(seg_sup_ptr + seg)
    nsrc = tl.load(src_cnt_ptr + sup * q + grp)
    if ACCUMULATE:
        if nsrc == 0:
            return
    start = tl.load(seg_start_ptr + seg)
    count = tl.load(seg_count_ptr + seg)
    r = local * BM + tl.arange(0, BM)
    rmask = r < count
    rows = tl.load(perm_ptr + start + r, mask=rmask, other=0).to(tl.int64)
    cols = n0 + tl.arange(0, BN)
    cmask = cols < n1
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for i in range(0, nsrc):
        beta = tl.load(src_ptr + (sup * q + grp) * MAXSRC + i)
        k0 = tl.load(red_off_ptr + beta)
        k1 = tl.load(red_off_ptr + beta + 1)
        for k in range(k0, k1, BK):
            ks = k + tl.arange(0, BK)
            kmask = ks < k1
            a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                        mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                        mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = _dot_acc(a, w, acc, UPCAST, IEEE)
    out = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    omask = rmask[:, None] & cmask[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=omask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def support_decode_kernel(
    a_ptr, w_ptr, out_ptr, types_ptr,
    src_ptr, src_cnt_ptr, red_off_ptr, col_off_ptr, q,
    stride_am, stride_ak, stride_wk, stride_wn, stride_om, stride_on,
    MAXSRC: tl.constexpr, Q_P2: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """One row, one output tile: ``out[m, cols] = sum_beta a[m, red(beta)] w[red(beta), cols]``."""
    m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    alpha = tl.load(types_ptr + m).to(tl.int32)
    grp, n0, n1 = _locate_cols(pid_n, col_off_ptr, q, Q_P2, BN)
    if grp >= q:
        return
    nsrc = tl.load(src_cnt_ptr + alpha * q + grp)
    cols = n0 + tl.arange(0, BN)
    cmask = cols < n1
    acc = tl.zeros((BN,), dtype=tl.float32)
    for i in range(0, nsrc):
        beta = tl.load(src_ptr + (alpha * q + grp) * MAXSRC + i)
        k0 = tl.load(red_off_ptr + beta)
        k1 = tl.load(red_off_ptr + beta + 1)
        for k in range(k0, k1, BK):
            ks = k + tl.arange(0, BK)
            kmask = ks < k1
            a = tl.load(a_ptr + m * stride_am + ks * stride_ak, mask=kmask, other=0.0)
            w = tl.load(w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                        mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32)[:, None] * w.to(tl.float32), axis=0)
    tl.store(out_ptr + m * stride_om + cols * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=cmask)


@triton.jit
def support_dw_kernel(
    g_ptr, x_ptr, dw_ptr,
    perm_ptr, seg_start_ptr, seg_count_ptr,
    blk_beta_ptr, blk_delta_ptr, blk_types_ptr, blk_ntypes_ptr, in_off_ptr, out_off_ptr,
    tile_ptr,
    stride_gm, stride_gn, stride_xm, stride_xk, stride_dn, stride_dk,
    MAXT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """``dW[n-tile, k-tile] = sum_{alpha uses block} g[rows_alpha, n]^T x[rows_alpha, k]``."""
    pid = tl.program_id(0)
    blk = tl.load(tile_ptr + pid * 3)
    n0 = tl.load(tile_ptr + pid * 3 + 1)
    k0 = tl.load(tile_ptr + pid * 3 + 2)
    beta = tl.load(blk_beta_ptr + blk)
    delta = tl.load(blk_delta_ptr + blk)
    n1 = tl.load(out_off_ptr + delta + 1)
    k1 = tl.load(in_off_ptr + beta + 1)
    ns = n0 + tl.arange(0, BN)
    ks = k0 + tl.arange(0, BK)
    nmask = ns < n1
    kmask = ks < k1
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    ntypes = tl.load(blk_ntypes_ptr + blk)
    for t in range(0, ntypes):
        alpha = tl.load(blk_types_ptr + blk * MAXT + t)
        start = tl.load(seg_start_ptr + alpha)
        count = tl.load(seg_count_ptr + alpha)
        for r0 in range(0, count, BM):
            r = r0 + tl.arange(0, BM)
            rmask = r < count
            rows = tl.load(perm_ptr + start + r, mask=rmask, other=0).to(tl.int64)
            g = tl.load(g_ptr + rows[None, :] * stride_gm + ns[:, None] * stride_gn,
                        mask=rmask[None, :] & nmask[:, None], other=0.0)
            xx = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                         mask=rmask[:, None] & kmask[None, :], other=0.0)
            acc = _dot_acc(g, xx, acc, UPCAST, IEEE)
    tl.store(dw_ptr + ns[:, None] * stride_dn + ks[None, :] * stride_dk,
             acc.to(dw_ptr.dtype.element_ty), mask=nmask[:, None] & kmask[None, :])


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (>= 1)."""
    return int(triton.next_power_of_2(max(1, n)))
