"""Where a large-q algebra layer's time goes at M = 2048: the two passes of diag-first.

``python benchmarks/large_q_passes.py [--algebras Q8,Q16,Q32] [--trials 9] [--out PREFIX]``

At ``M = 2048`` (K = N = 4096, cyclic types, every type with M/q rows) the route runs
``Q_q`` as diag-first (``structlm.ops.blocked``): **pass A**, the diagonal blocks for every
row as one batched GEMM (q products of ``(M, s) x (s, s)``, s = K/q), written into the
output; **pass B**, each type's row of blocks (its input group against every other
output group: two GEMMs per type of ``(M/q, s) x (s, ~N/2)``) accumulated into the
output's rows of that type. Each pass does about half of the layer's multiply-adds with
an inner dimension of only ``s`` (256 for Q16, 128 for Q32), and each reads and writes
the whole ``(M, N)`` output.

Rows, timed interleaved (medians) in one process: the dense ``F.linear`` (the fastest
dense path at this M), the layer as routed, pass A alone, pass B alone; GMAC/s of each
counts the multiply-adds it does; ``% of ideal`` is the layer's speed-up over dense
against the MAC ideal ``q^2 / (2q - 1)``; ``A+B at the dense rate`` is the time both
passes would take at the dense GEMM's GMAC/s of the same run (the ideal). Two more
rows name the limit of any decomposition into GEMMs with the support's inner dimension:
the same dense GEMM (M rows, N outputs) with an inner dimension of only ``s`` and ``2s``
(a type's output group reads at most two blocks: its diagonal one and its own input
group's), and ``at the 2s rate: % of ideal`` — the share of the MAC ideal a one-pass
kernel reaches if it runs at that GEMM's rate. And pass B with each type's slice of the
weight packed once (MKL's packed GEMM, ``torch.ops.mkl._mkl_linear``, the rows of each
type gathered, the outputs left unplaced: a lower bound on its time), with the memory one
packed slice takes; and the layer with the fused-rows kernel forced (the route's choice
up to 16 rows per type). CSV with the environment and a Markdown table drawn from it.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from structlm.bench.timing import environment_line, interleaved_medians, write_csv_and_markdown
from structlm.cpu_malloc import retain_freed_memory
from structlm.nn import AlgebraLinear
from structlm.ops import blocked
from structlm.ops.partition import TypePartition
from structlm.ops.route import Route, force_layout, trace


def _pass_b(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, layer: AlgebraLinear,
            part: TypePartition) -> None:
    """Every type's non-common runs accumulated into its rows (diag-first's second pass)."""
    for a in part.present:
        rows = part.sets[a].rows
        assert rows is not None, "cyclic rows are evenly spaced: a view, no gather"
        blocked._forward_runs(x[rows], y[rows], w, layer.plan, layer.plan.type_runs[a], None)


def measure(algebra: str, m: int, k: int, trials: int) -> dict[str, object]:
    """One algebra's row: dense, the routed layer, pass A and pass B (seconds, GMAC/s)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen)
    layer = AlgebraLinear(k, k, algebra).requires_grad_(False)
    q = layer.plan.q
    part = TypePartition(torch.arange(m) % q, q)
    w = layer.weight
    with trace() as rec:
        layer(x, part)
    route = rec[0].decision.route
    if route is not Route.DIAG_FIRST:
        raise RuntimeError(f"{algebra} at M = {m} routes to {route}, not diag-first: the "
                           "pass split below would not describe it")
    y_b = blocked._forward_common(x, w, layer.plan)  # pass B accumulates into a written y
    s = k // q
    x1, x2 = x[:, :s].contiguous(), x[:, :2 * s].contiguous()
    # pass B with the weight packed once (MKL's packed GEMM, as torch.compile's freezing
    # uses it): each type's rows gathered, its full row of blocks, outputs not placed
    mq = m // q
    xs = [x[t::q, t * s:(t + 1) * s].contiguous() for t in range(q)]
    ws = [w[:, t * s:(t + 1) * s].contiguous() for t in range(q)]
    packs = [torch.ops.mkl._mkl_reorder_linear_weight(wt, mq) for wt in ws]

    def pass_b_packed() -> None:
        for t in range(q):
            torch.ops.mkl._mkl_linear(xs[t], packs[t], ws[t], None, mq)

    def fused_rows() -> None:
        with force_layout("fused-rows"):
            layer(x, part)

    fns = [lambda: F.linear(x, w), lambda: layer(x, part),
           lambda: blocked._forward_common(x, w, layer.plan),
           lambda: _pass_b(x, y_b, w, layer, part),
           lambda: F.linear(x1, w[:, :s]), lambda: F.linear(x2, w[:, :2 * s]),
           pass_b_packed, fused_rows]
    t_dense, t_layer, t_a, t_b, t_s, t_2s, t_bp, t_fr = interleaved_medians(fns, trials)
    macs_a, macs_dense = m * s * s * q, m * k * k
    macs_layer = macs_dense * (2 * q - 1) / q**2
    macs_b = macs_layer - macs_a
    dense_rate = macs_dense / t_dense
    ideal = q**2 / (2 * q - 1)
    return {"algebra": algebra, "M": m, "K": k, "N": k, "route": str(route),
            "dense_ms": 1e3 * t_dense, "layer_ms": 1e3 * t_layer,
            "pass_a_ms": 1e3 * t_a, "pass_b_ms": 1e3 * t_b,
            "dense_gmacs": dense_rate / 1e9, "pass_a_gmacs": macs_a / t_a / 1e9,
            "pass_b_gmacs": macs_b / t_b / 1e9, "speedup": t_dense / t_layer,
            "ideal": ideal, "pct_ideal": 100 * t_dense / t_layer / ideal,
            "ab_at_dense_rate_ms": 1e3 * macs_layer / dense_rate,
            "gemm_k_s_gmacs": m * s * k / t_s / 1e9,
            "gemm_k_2s_gmacs": m * 2 * s * k / t_2s / 1e9,
            "one_pass_bound_pct": 100 * (m * 2 * s * k / t_2s) / dense_rate,
            "pass_b_packed_gmacs": m * s * k / t_bp / 1e9,
            "packed_mib_per_type": packs[0].numel() * 4 / 2**20,
            "weight_mib_per_type": ws[0].numel() * 4 / 2**20,
            "fused_rows_pct_ideal": 100 * t_dense / t_fr / ideal}


def markdown(rows: list[dict[str, str]]) -> str:
    """The table drawn from the CSV rows."""
    head = ("| algebra | M | dense ms (GMAC/s) | layer ms | speed-up | ideal | % of ideal "
            "| pass A ms (GMAC/s) | pass B ms (GMAC/s) | A+B at the dense rate, ms "
            "| dense GEMM, inner dim s / 2s: GMAC/s | at the 2s rate: % of ideal "
            "| pass B, weights packed once: GMAC/s | packed MiB per type (its slice) "
            "| fused-rows kernel forced: % of ideal |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    body = "".join(
        f"| {r['algebra']} | {r['M']} | {float(r['dense_ms']):.1f} "
        f"({float(r['dense_gmacs']):.0f}) | {float(r['layer_ms']):.1f} | "
        f"{float(r['speedup']):.2f}× | {float(r['ideal']):.2f}× | "
        f"{float(r['pct_ideal']):.0f}% | {float(r['pass_a_ms']):.1f} "
        f"({float(r['pass_a_gmacs']):.0f}) | {float(r['pass_b_ms']):.1f} "
        f"({float(r['pass_b_gmacs']):.0f}) | {float(r['ab_at_dense_rate_ms']):.1f} | "
        f"{float(r['gemm_k_s_gmacs']):.0f} / {float(r['gemm_k_2s_gmacs']):.0f} | "
        f"{float(r['one_pass_bound_pct']):.0f}% | {float(r['pass_b_packed_gmacs']):.0f} | "
        f"{float(r['packed_mib_per_type']):.1f} ({float(r['weight_mib_per_type']):.1f}) | "
        f"{float(r['fused_rows_pct_ideal']):.0f}% |\n"
        for r in rows)
    return ("# Large q at M = 2048: diag-first's two passes\n\n"
            "`python benchmarks/large_q_passes.py`\n\n" + head + body + "\n"
            + environment_line(rows) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algebras", default="Q8,Q16,Q32")
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench-out/large_q_passes")
    args = ap.parse_args()
    retain_freed_memory()  # as the structlm command does: outputs reuse warm pages
    torch.set_num_threads(args.threads)
    rows = []
    with torch.no_grad():
        for alg in args.algebras.split(","):
            row = measure(alg, args.m, args.k, args.trials)
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()})
            rows.append(row)
    write_csv_and_markdown(args.out, rows, markdown)


if __name__ == "__main__":
    main()
