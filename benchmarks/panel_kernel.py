"""The few-row kernels' arithmetic rate: the panel kernel (rows of mixed types) against
the dense dot-product loop and MKL, bare calls, weights warm or (``--flush``) cold.

``python benchmarks/panel_kernel.py [--threads 1] [--flush] [--out PREFIX]``

Rows:

* ``dense`` — a dense ``(N, K)`` weight at M rows: MKL (``torch.mm``), the dense
  dot-product loop (``dense_rows_forward``, weight in place) and the panel kernel on
  its panel-packed copy (``fused_rows_forward`` with the one-group support);
* ``Q4`` .. ``Q32`` — an algebra layer at M rows of cyclic types (every type present),
  the panel kernel on its panel-packed copy: the rows of the issue's M = 32 target.

``--layouts``: instead, the layer at M rows of cyclic types (K = N = 4096, caches
flushed) with the ``fused-rows`` layout forced against the best PyTorch layout
(the route's choice without the kernel), 16 to 1024 rows per type (at most 8192 rows) —
the measurement behind ``kernel_max_rows_per_type`` in ``structlm.ops.route.THRESHOLDS``.

GMAC/s counts the support's multiply-adds (``fused_rows_macs``). Interleaved rounds,
medians (with ``--flush`` a 512 MiB read before each call, and the dense rows at
M = 1..32 on 4096x4096 and the FFN shapes: where the dense panel path starts to pay);
CSV with the environment and a Markdown table drawn from it.
"""

from __future__ import annotations

import argparse

import torch

from structlm.bench.timing import (
    CacheFlusher,
    environment_line,
    interleaved_medians,
    write_csv_and_markdown,
)
from structlm.cpu_malloc import retain_freed_memory
from structlm.nn import AlgebraLinear
from structlm.ops import cpu_kernels
from structlm.ops.partition import TypePartition

#: ``--layouts``: (algebra, types) and the most rows timed
LAYOUT_ALGEBRAS = (("Q2", 2), ("Q4", 4), ("Q2^2", 4), ("Q8", 8), ("Q16", 16), ("Q32", 32))
LAYOUT_MAX_ROWS = 8192


def _rate(macs: int, seconds: float) -> float:
    return round(macs / seconds / 1e9, 2)


def dense_rows(k: int, n: int, m: int, trials: int, flush: CacheFlusher | None
               ) -> list[dict[str, object]]:
    w, x = torch.randn(n, k), torch.randn(m, k)
    mod = cpu_kernels.kernel_for(x, w)
    packed = cpu_kernels.dense_packed_weight(w)
    tables = cpu_kernels.dense_tables(n, k)
    types = torch.zeros(m, dtype=torch.int64)
    fns = {"MKL": lambda: torch.mm(x, w.t()),
           "dot loop": lambda: mod.dense_rows_forward(x, w, None),
           "panel": lambda: mod.fused_rows_forward(x, packed, types, *tables, 1, None)}
    t = dict(zip(fns, interleaved_medians(list(fns.values()), trials, warmup=3,
                                          before_each=flush), strict=True))
    return [{"case": "dense", "K": k, "N": n, "M": m, "path": p, "ms": round(v * 1e3, 4),
             "gmacs": _rate(m * n * k, v), "flushed": flush is not None}
            for p, v in t.items()]


def algebra_rows(alg: str, k: int, n: int, m: int, trials: int, flush: CacheFlusher | None
                 ) -> list[dict[str, object]]:
    layer = AlgebraLinear(k, n, alg).requires_grad_(False)
    part = TypePartition(torch.arange(m) % layer.q, layer.q)
    x = torch.randn(m, k)
    mod = cpu_kernels.kernel_for(x, layer.weight)
    packed = cpu_kernels.packed_weight(layer.weight, layer.plan)
    tables = cpu_kernels.block_tables(layer.plan)
    types = part.types.long()
    macs = cpu_kernels.fused_rows_macs(layer.plan, part)
    t = interleaved_medians([lambda: mod.fused_rows_forward(x, packed, types, *tables,
                                                            layer.q, None)], trials, warmup=3,
                            before_each=flush)
    return [{"case": alg, "K": k, "N": n, "M": m, "path": "panel",
             "ms": round(t[0] * 1e3, 4), "gmacs": _rate(macs, t[0]),
             "flushed": flush is not None}]


def layout_rows(alg: str, m: int, trials: int, flush: CacheFlusher
                ) -> list[dict[str, object]]:
    from structlm.ops.route import AlgebraCall, Backend, choose, force_layout

    layer = AlgebraLinear(4096, 4096, alg).requires_grad_(False)
    x = torch.randn(m, 4096)
    part = layer.partition(torch.arange(m) % layer.q)
    best = choose(AlgebraCall(x, layer.weight, layer.plan, part, Backend.BLOCKED,
                              kernel=False)).route
    macs = cpu_kernels.fused_rows_macs(layer.plan, part)

    def forced(name: str):
        def run() -> object:
            with torch.no_grad(), force_layout(name):
                return layer(x, part)
        return run

    t = interleaved_medians([forced("fused-rows"), forced(best)], trials, warmup=2,
                            before_each=flush)
    return [{"case": alg, "K": 4096, "N": 4096, "M": m, "path": p, "ms": round(v * 1e3, 4),
             "gmacs": _rate(macs, v), "flushed": True}
            for p, v in zip(("fused-rows", best), t, strict=True)]


def markdown(rows: list[dict[str, str]]) -> str:
    lines = [environment_line(rows), "",
             "| case | K×N | M | path | flushed | ms | GMAC/s |",
             "|---|---|---:|---|---|---:|---:|"]
    lines += [f"| {r['case']} | {r['K']}×{r['N']} | {r['M']} | {r['path']} | {r['flushed']} | "
              f"{r['ms']} | {r['gmacs']} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--flush", action="store_true", help="read 512 MiB before each call")
    ap.add_argument("--layouts", action="store_true",
                    help="fused-rows against the best PyTorch layout, flushed, 16-1024 rows "
                         "per type")
    ap.add_argument("--out", default="benchmarks/results/panel_kernel_cpu")
    args = ap.parse_args(argv)
    if not cpu_kernels.fused_rows_available():
        raise SystemExit("the compiled rows kernel is not available: nothing to time")
    retain_freed_memory()  # large outputs reuse warm pages (recorded in the environment)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows: list[dict[str, object]] = []
    flush = CacheFlusher() if args.flush or args.layouts else None
    # 16 to 1024 rows per type, at most LAYOUT_MAX_ROWS rows in all
    cases = (tuple((alg, per * q) for alg, q in LAYOUT_ALGEBRAS for per in (16, 64, 256, 1024)
                   if per * q <= LAYOUT_MAX_ROWS) if args.layouts else ())
    for alg, m in cases:
        assert flush is not None
        rows += layout_rows(alg, m, args.trials, flush)
    dense_shapes = ((4096, 4096), (576, 1536), (1536, 576), (768, 1536)) if flush else (
        (1024, 1024), (576, 1536), (1536, 576))
    if hasattr(cpu_kernels, "dense_packed_weight") and not args.layouts:  # (absent before)
        for k, n in dense_shapes:
            for m in ((1, 4, 8, 32) if flush else (8, 32)):
                rows += dense_rows(k, n, m, args.trials, flush)
    for k in (() if args.layouts else (1024, 2048, 4096)):
        for alg in ("Q4", "Q8", "Q16", "Q32"):
            rows += algebra_rows(alg, k, k, 32, args.trials, flush)
    for r in rows:
        print(f"{r['case']:5s} {r['K']}x{r['N']} M={r['M']:<3} {r['path']:8s} "
              f"{r['ms']:9.3f} ms {r['gmacs']:7.2f} GMAC/s", flush=True)
    write_csv_and_markdown(args.out, rows, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
