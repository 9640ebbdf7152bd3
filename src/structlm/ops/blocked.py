"""The ``blocked`` backend: pure-PyTorch GEMMs over exactly the support's blocks.

Five layouts, all doing exactly the MACs of the cost model in forward, ``dX`` and
``dW`` (a custom autograd function: no masked dense product anywhere):

* **diag-first** (any support, any widths): the common blocks for all rows (one
  batched GEMM when they are the diagonal with equal widths, written straight into
  the output), then, per type, one GEMM per run of its remaining blocks,
  accumulated in place (``addmm_``) into views of the output rows when the rows of
  that type are evenly spaced (cyclic or contiguous schedules), else on gathered
  rows.
* **output-major** (few rows of one type, e.g. cached decode at batch 1; or many rows of
  several types on small weights, where a weight block read once per type costs nothing
  and the GEMMs' depth is what counts): each present type's blocks, common ones
  included, as a handful of rectangles ``W[out d0:d1, in b0:b1]`` (one GEMM each, as deep
  as the rectangle is wide, no batched diagonal GEMM), in forward, ``dX`` and ``dW``.
* **fused-rows** (CPU, float32/float64, the weight not trained, at most
  ``kernel_max_rows_per_type`` rows per type on average, i.e. ``1024 q`` rows, in float32
  on a build with the AVX-512 loops, else ``kernel_portable_max_rows_per_type``, any types):
  one call of a compiled kernel (:mod:`.cpu_kernels`) that streams through exactly the
  blocks the rows' types use, in a panel-packed copy of the weight; the backward
  is diag-first's.
  Where the kernel cannot be built it is never chosen.
* **block-major** (supports whose extra blocks are shared by several types, e.g.
  ``Q2^2``, with several types present): the rows sorted by type once (in the order
  :attr:`~structlm.ops.plan.BlockPlan.sorted_type_order` that keeps each shared block's
  types adjacent), then every weight block once, on the contiguous rows of all the
  types that use it (per-type runs would read a shared block once per type); the
  results are put back in row order once. Sorted, a shared block's rows are views, so
  no GEMM output is scattered into strided columns.
* **row-first gathered** (``Q_q``-shaped supports, equal widths, every type with
  the same small number of rows, e.g. ``M = 32`` cyclic): each type's full weight
  row as one batched GEMM over types, then the diagonal blocks of the *other*
  groups as a second batched GEMM — a fixed number of GEMM calls whatever ``q``.

Which layout runs is :func:`structlm.ops.route.choose`'s decision (its thresholds and
the measurements behind them are in :data:`structlm.ops.route.THRESHOLDS`).

Weight layout is ``nn.Linear``'s: ``weight[out, in]``; block ``(beta, delta)`` is
``weight[out_delta, in_beta]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from structlm.ops import cpu_kernels
from structlm.ops.partition import RowSet, TypePartition, TypeSortedRows
from structlm.ops.plan import BlockPlan, Run
from structlm.ops.route import KERNEL_DTYPES, AlgebraCall, Backend, Route, choose

__all__ = ["blocked_linear"]


# ----------------------------------------------------------------- helpers
def _diag_views(w: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """``(q, r, s)`` view of the diagonal blocks of ``w (N, K)`` (equal widths)."""
    q, k = plan.q, plan.in_features
    s, r = plan.in_offsets[1], plan.out_offsets[1]
    return w.as_strided((q, r, s), (r * k + s, k, 1), w.storage_offset())


def _group_view(t: torch.Tensor, q: int) -> torch.Tensor:
    """``(M, q*w) -> (q, M, w)`` view of equal-width column groups."""
    m, c = t.shape
    return t.view(m, q, c // q).transpose(0, 1)


def _cols(offsets: tuple[int, ...], g0: int, g1: int) -> slice:
    return slice(offsets[g0], offsets[g1])


def _split_by_status(beta: int, d0: int, d1: int,
                     written: torch.Tensor) -> list[tuple[int, int, bool]]:
    """Split the run ``[d0, d1)`` into maximal pieces of equal ``written[beta, d]``."""
    pieces: list[tuple[int, int, bool]] = []
    d = d0
    while d < d1:
        st = bool(written[beta, d])
        e = d
        while e < d1 and bool(written[beta, e]) == st:
            e += 1
        pieces.append((d, e, st))
        d = e
    return pieces


# ----------------------------------------------------------------- forward
def _forward_runs(xr: torch.Tensor, yr: torch.Tensor, w: torch.Tensor, plan: BlockPlan,
                  runs: tuple[Run, ...], fresh: list[bool] | None) -> None:
    """``yr[:, out run] (+)= xr[:, in beta] @ W[out run, in beta]^T`` for each run.

    ``fresh[d]`` True means output group ``d`` of ``yr`` is not yet written (the
    first run writing it overwrites; the others accumulate)."""
    io, oo = plan.in_offsets, plan.out_offsets
    for beta, d0, d1 in runs:
        xs = xr[:, _cols(io, beta, beta + 1)]
        d = d0
        while d < d1:
            st = fresh is not None and fresh[d]
            e = d
            while e < d1 and (fresh is not None and fresh[e]) == st:
                e += 1
            cs = _cols(oo, d, e)
            wt = w[cs, _cols(io, beta, beta + 1)].t()
            if st:
                torch.mm(xs, wt, out=yr[:, cs])
                for g in range(d, e):
                    fresh[g] = False  # type: ignore[index]
            else:
                yr[:, cs].addmm_(xs, wt)
            d = e


def _forward_common(x: torch.Tensor, w: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """``y`` with the common blocks applied to every row (one bmm for the diagonal)."""
    m, n = x.shape[0], plan.out_features
    if plan.common_covers_outputs:
        y = x.new_empty(m, n)
    else:
        y = x.new_zeros(m, n)
    if plan.common_is_diag and plan.equal_widths and plan.q > 1:
        torch.bmm(_group_view(x, plan.q), _diag_views(w, plan).transpose(1, 2),
                  out=_group_view(y, plan.q))
    else:
        fresh = [plan.common_covers_outputs] * plan.q
        _forward_runs(x, y, w, plan, plan.common_runs, fresh)
    return y


def _forward_diag_first(x: torch.Tensor, w: torch.Tensor, plan: BlockPlan,
                        part: TypePartition) -> torch.Tensor:
    y = _forward_common(x, w, plan)
    for a in part.present:
        runs = plan.type_runs[a]
        if not runs:
            continue
        rs = part.sets[a]
        if rs.rows is not None:
            _forward_runs(x[rs.rows], y[rs.rows], w, plan, runs, None)
        else:
            assert rs.index is not None
            yr = y.index_select(0, rs.index)
            _forward_runs(x.index_select(0, rs.index), yr, w, plan, runs, None)
            y.index_copy_(0, rs.index, yr)
    return y


def _forward_output_major(x: torch.Tensor, w: torch.Tensor, plan: BlockPlan,
                          part: TypePartition) -> torch.Tensor:
    io, oo = plan.in_offsets, plan.out_offsets
    y = x.new_empty(x.shape[0], plan.out_features)
    for a in part.present:
        rs = part.sets[a]
        xr = x[rs.rows] if rs.rows is not None else x.index_select(0, rs.index)
        yr = y[rs.rows] if rs.rows is not None else torch.empty_like(y[: rs.count])
        covered = [False] * plan.q
        for d0, d1, b0, b1 in plan.type_rects[a]:
            cs, bs = slice(oo[d0], oo[d1]), slice(io[b0], io[b1])
            if covered[d0]:
                yr[:, cs].addmm_(xr[:, bs], w[cs, bs].t())
            else:
                torch.mm(xr[:, bs], w[cs, bs].t(), out=yr[:, cs])
                covered[d0:d1] = [True] * (d1 - d0)
        for d in range(plan.q):
            if not covered[d]:  # an output group this type never writes (general graphs)
                yr[:, oo[d]:oo[d + 1]].zero_()
        if rs.rows is None:
            y.index_copy_(0, rs.index, yr)
    return y


def _forward_fused_rows(x: torch.Tensor, w: torch.Tensor, plan: BlockPlan,
                        part: TypePartition) -> torch.Tensor:
    if (x.device.type != "cpu" or x.dtype not in KERNEL_DTYPES
            or not cpu_kernels.fused_rows_available()):
        return _forward_output_major(x, w, plan, part)  # e.g. bf16: the PyTorch rectangles
    return cpu_kernels.fused_rows_linear(x, w, plan, part)


def _forward_gathered(x: torch.Tensor, w: torch.Tensor, plan: BlockPlan,
                      part: TypePartition) -> torch.Tensor:
    q, m, n = plan.q, x.shape[0], plan.out_features
    s, r = plan.in_offsets[1], plan.out_offsets[1]
    grp = torch.arange(q, device=x.device)[:, None]
    idx, comp = part.sorted_index(), part.complement_index()
    x3 = x.view(m, q, s)
    y = x.new_empty(m, n)
    w_rows = w.view(n, q, s).permute(1, 2, 0)  # (q, s, N): full weight row of each type
    y[idx] = torch.bmm(x3[idx, grp], w_rows)  # (q, M/q, N)
    xd = x3[comp, grp]  # (q, (q-1)M/q, s): rows not of type d, group d
    yd = torch.bmm(xd, _diag_views(w, plan).transpose(1, 2))  # (q, (q-1)M/q, r)
    y.view(m, q, r).index_put_((comp, grp), yd, accumulate=True)
    return y


# ---------------------------------------------------------------- backward
def _dx_runs(gr: torch.Tensor, dxr: torch.Tensor, w: torch.Tensor, plan: BlockPlan,
             runs: tuple[Run, ...], fresh: list[bool] | None) -> None:
    """``dxr[:, in beta] (+)= gr[:, out run] @ W[out run, in beta]`` for each run."""
    io, oo = plan.in_offsets, plan.out_offsets
    for beta, d0, d1 in runs:
        cs, bs = _cols(oo, d0, d1), _cols(io, beta, beta + 1)
        if fresh is not None and fresh[beta]:
            torch.mm(gr[:, cs], w[cs, bs], out=dxr[:, bs])
            fresh[beta] = False
        else:
            dxr[:, bs].addmm_(gr[:, cs], w[cs, bs])


def _dw_runs(gr: torch.Tensor, xr: torch.Tensor, dw: torch.Tensor, plan: BlockPlan,
             runs: tuple[Run, ...], written: torch.Tensor) -> None:
    """``dW[out run, in beta] (+)= gr[:, out run]^T @ xr[:, in beta]`` for each run."""
    io, oo = plan.in_offsets, plan.out_offsets
    for beta, d0, d1 in runs:
        bs = _cols(io, beta, beta + 1)
        for e0, e1, was in _split_by_status(beta, d0, d1, written):
            cs = _cols(oo, e0, e1)
            if was:
                dw[cs, bs].addmm_(gr[:, cs].t(), xr[:, bs])
            else:
                torch.mm(gr[:, cs].t(), xr[:, bs], out=dw[cs, bs])
                written[beta, e0:e1] = True


def _backward_common(gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, plan: BlockPlan,
                     need_dx: bool, need_dw: bool
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """``dX`` and ``dW`` of the common blocks (all rows); returns the written-block mask."""
    q = plan.q
    bmm_diag = plan.common_is_diag and plan.equal_widths and q > 1
    dx = dw = None
    written = torch.zeros(q, q, dtype=torch.bool)
    if need_dx:
        dx = gy.new_empty(x.shape) if plan.common_covers_inputs else gy.new_zeros(x.shape)
        if bmm_diag:
            torch.bmm(_group_view(gy, q), _diag_views(w, plan), out=_group_view(dx, q))
        else:
            _dx_runs(gy, dx, w, plan, plan.common_runs, [plan.common_covers_inputs] * q)
    if need_dw:
        dw = w.new_empty(w.shape, dtype=gy.dtype)
        if bmm_diag:
            torch.bmm(_group_view(gy, q).transpose(1, 2), _group_view(x, q),
                      out=_diag_views(dw, plan))
            written.fill_diagonal_(True)
        else:
            _dw_runs(gy, x, dw, plan, plan.common_runs, written)
    return dx, dw, written


def _zero_unwritten(dw: torch.Tensor, plan: BlockPlan, written: torch.Tensor) -> None:
    """Zero the gradient of blocks no row used (dead blocks, absent types)."""
    io, oo = plan.in_offsets, plan.out_offsets
    for beta, delta in (~written).nonzero().tolist():
        dw[_cols(oo, delta, delta + 1), _cols(io, beta, beta + 1)].zero_()


def _backward_diag_first(gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, plan: BlockPlan,
                         part: TypePartition, need_dx: bool, need_dw: bool
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    dx, dw, written = _backward_common(gy, x, w, plan, need_dx, need_dw)
    for a in part.present:
        runs = plan.type_runs[a]
        if not runs:
            continue
        rs: RowSet = part.sets[a]
        if rs.rows is not None:
            gr = gy[rs.rows]
            if dx is not None:
                _dx_runs(gr, dx[rs.rows], w, plan, runs, None)
            if dw is not None:
                _dw_runs(gr, x[rs.rows], dw, plan, runs, written)
        else:
            assert rs.index is not None
            gr = gy.index_select(0, rs.index)
            if dx is not None:
                dxr = dx.index_select(0, rs.index)
                _dx_runs(gr, dxr, w, plan, runs, None)
                dx.index_copy_(0, rs.index, dxr)
            if dw is not None:
                _dw_runs(gr, x.index_select(0, rs.index), dw, plan, runs, written)
    if dw is not None:
        _zero_unwritten(dw, plan, written)
    return dx, dw


def _backward_output_major(gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                           plan: BlockPlan, part: TypePartition, need_dx: bool,
                           need_dw: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Each present type's rectangles, as in its forward: ``dX[rows, in] += gY[rows, out]
    @ W[out, in]`` and ``dW[out, in] += gY[rows, out]^T @ X[rows, in]`` per rectangle (a
    GEMM over all of the type's rows: K = its row count for ``dW``), accumulated into
    zeroed gradients (blocks and input groups no row reads stay zero)."""
    io, oo = plan.in_offsets, plan.out_offsets
    dx = gy.new_zeros(x.shape) if need_dx else None
    dw = w.new_zeros(w.shape, dtype=gy.dtype) if need_dw else None
    for a in part.present:
        rs: RowSet = part.sets[a]
        gathered = rs.rows is None
        if gathered:  # copies of the type's rows (dX's written back below)
            gr = gy.index_select(0, rs.index)
            xr = x.index_select(0, rs.index) if dw is not None else None
            dxr = dx.new_zeros(rs.count, x.shape[1]) if dx is not None else None
        else:  # views
            gr, xr = gy[rs.rows], x[rs.rows]
            dxr = dx[rs.rows] if dx is not None else None
        for d0, d1, b0, b1 in plan.type_rects[a]:
            cs, bs = slice(oo[d0], oo[d1]), slice(io[b0], io[b1])
            if dxr is not None:
                dxr[:, bs].addmm_(gr[:, cs], w[cs, bs])
            if dw is not None:
                assert xr is not None
                dw[cs, bs].addmm_(gr[:, cs].t(), xr[:, bs])
        if gathered and dx is not None:
            dx.index_copy_(0, rs.index, dxr)
    return dx, dw


# ------------------------------------------------------------- block-major
def _shared_run_ranges(plan: BlockPlan, rows: TypeSortedRows
                       ) -> Iterator[tuple[list[tuple[int, int]], slice, slice, int, int, int]]:
    """``(sorted row ranges, in cols, out cols, beta, d0, d1)`` of every shared run with
    rows (its types' rows are a few contiguous ranges of the type-sorted rows)."""
    io, oo = plan.in_offsets, plan.out_offsets
    for beta, d0, d1, types in plan.shared_runs:
        ranges = rows.ranges(types)
        if ranges:
            yield ranges, _cols(io, beta, beta + 1), _cols(oo, d0, d1), beta, d0, d1


def _forward_block_major(x: torch.Tensor, w: torch.Tensor, plan: BlockPlan,
                         part: TypePartition) -> torch.Tensor:
    rows = part.type_sorted(plan.sorted_type_order)
    xs = rows.sort(x)  # (M, K) type-sorted: every shared block's rows are views
    ys = _forward_common(xs, w, plan)  # (M, N)
    for ranges, bs, cs, *_ in _shared_run_ranges(plan, rows):
        wt = w[cs, bs].t()
        for a, b in ranges:
            ys[a:b, cs].addmm_(xs[a:b, bs], wt)
    return rows.unsort(ys)


def _backward_block_major(gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, plan: BlockPlan,
                          part: TypePartition, need_dx: bool, need_dw: bool
                          ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    rows = part.type_sorted(plan.sorted_type_order)
    gs, xs = rows.sort(gy), rows.sort(x)  # (M, N), (M, K) type-sorted
    dxs, dw, written = _backward_common(gs, xs, w, plan, need_dx, need_dw)
    for ranges, bs, cs, beta, d0, d1 in _shared_run_ranges(plan, rows):
        for i, (a, b) in enumerate(ranges):
            if dxs is not None:
                dxs[a:b, bs].addmm_(gs[a:b, cs], w[cs, bs])
            if dw is not None:  # every non-common block lies in exactly one shared run
                if i == 0:
                    torch.mm(gs[a:b, cs].t(), xs[a:b, bs], out=dw[cs, bs])
                else:
                    dw[cs, bs].addmm_(gs[a:b, cs].t(), xs[a:b, bs])
        if dw is not None:
            written[beta, d0:d1] = True
    if dw is not None:
        _zero_unwritten(dw, plan, written)
    return (None if dxs is None else rows.unsort(dxs)), dw


def _backward_gathered(gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, plan: BlockPlan,
                       part: TypePartition, need_dx: bool, need_dw: bool
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    q, m, n = plan.q, x.shape[0], plan.out_features
    s, r = plan.in_offsets[1], plan.out_offsets[1]
    grp = torch.arange(q, device=x.device)[:, None]
    idx, comp = part.sorted_index(), part.complement_index()
    gr = gy[idx]  # (q, M/q, N)
    gd = gy.view(m, q, r)[comp, grp]  # (q, (q-1)M/q, r)
    dx = dw = None
    if need_dx:
        dx = gy.new_empty(x.shape)
        dx3 = dx.view(m, q, s)
        dx3[idx, grp] = torch.bmm(gr, w.view(n, q, s).transpose(0, 1))  # own group, full row
        dx3[comp, grp] = torch.bmm(gd, _diag_views(w, plan))  # other groups, diagonal
    if need_dw:
        x3 = x.view(m, q, s)
        dw = w.new_empty(w.shape, dtype=gy.dtype)
        torch.bmm(gr.transpose(1, 2), x3[idx, grp], out=dw.view(n, q, s).transpose(0, 1))
        _diag_views(dw, plan).baddbmm_(gd.transpose(1, 2), x3[comp, grp])
    return dx, dw


# ----------------------------------------------------------------- autograd
_FORWARD = {Route.KERNEL: _forward_fused_rows, Route.GATHERED: _forward_gathered,
            Route.BLOCK_MAJOR: _forward_block_major, Route.DIAG_FIRST: _forward_diag_first,
            Route.OUTPUT_MAJOR: _forward_output_major}
_BACKWARD = {Route.KERNEL: _backward_diag_first,  # only under a forced layout
             Route.GATHERED: _backward_gathered,
             Route.BLOCK_MAJOR: _backward_block_major, Route.DIAG_FIRST: _backward_diag_first,
             Route.OUTPUT_MAJOR: _backward_output_major}


class _BlockedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, plan: BlockPlan,
                part: TypePartition, layout: Route | None) -> torch.Tensor:
        # grad mode is off in here. A weight being trained never takes the kernel: its
        # packed copy would be rebuilt after every optimiser step (the version changes)
        if layout is None or (layout is Route.KERNEL and ctx.needs_input_grad[1]):
            layout = _layout(x, w, plan, part, kernel=not ctx.needs_input_grad[1])
        ctx.save_for_backward(x, w)
        # the compiled kernel has no backward (frozen weight, input gradient only): the
        # best PyTorch layout's
        back = _layout(x, w, plan, part, kernel=False) if layout is Route.KERNEL else layout
        ctx.plan, ctx.part, ctx.layout = plan, part, back
        return _FORWARD[layout](x, w, plan, part)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        gy = gy.contiguous()
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = _BACKWARD[ctx.layout](gy, x, w, ctx.plan, ctx.part, need_dx, need_dw)
        return dx, dw, None, None, None


def _layout(x: torch.Tensor, w: torch.Tensor, plan: BlockPlan, part: TypePartition,
            kernel: bool = True) -> Route:
    return choose(AlgebraCall(x, w, plan, part, Backend.BLOCKED, kernel=kernel)).route


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, plan: BlockPlan,
                   part: TypePartition, layout: Route | None = None) -> torch.Tensor:
    """``y = x @ W_eff(type)^T`` with exactly the support's MACs.

    Args:
        x: ``(M, K)`` input rows (made contiguous).
        weight: ``(N, K)`` weight in ``nn.Linear`` layout.
        plan: the layer's :class:`BlockPlan`.
        part: row sets of the ``M`` rows' types.
        layout: the route's layout for this call (:func:`structlm.ops.route.choose`);
            ``None``: asked here.

    Returns:
        ``(M, N)`` output.
    """
    if x.dtype != weight.dtype:
        raise TypeError(f"x has dtype {x.dtype} but the weight has {weight.dtype}")
    x, weight = x.contiguous(), weight.contiguous()
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        # inference: skip the autograd.Function machinery (it costs ~20 us a call)
        if layout is None:
            layout = _layout(x, weight, plan, part)
        return _FORWARD[layout](x, weight, plan, part)
    return _BlockedLinearFn.apply(x, weight, plan, part, layout)
