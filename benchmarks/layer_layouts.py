"""The blocked backend's layouts forced side by side at training-size batches.

``python benchmarks/layer_layouts.py [--trials 5] [--out PREFIX] [--cases NAME,...]``

For each case (an algebra, a weight shape and a batch of rows with a type schedule, the
shapes of the training-step presets' FFNs and 4096²), every layout that applies is forced
(:func:`structlm.ops.route.force_layout`) and timed against ``F.linear`` on the same
weight, forward alone (no autograd) and forward + backward (``dX`` and ``dW``), in
interleaved rounds, medians; 2 threads. Each row gives the share of the MAC ideal
(``F.linear`` time × ρ / layout time) and which layout the route takes unforced; the
dense arm is judged in absolute terms by its GFLOP/s against the float32 GEMM rate
measured before and after the run (these batches are compute-bound; llama.cpp has no
training step to compare with). This is
the measurement behind the route's ``output_major_min_rows`` and
``output_major_max_in_width`` thresholds. Writes ``<out>.csv`` (with the environment) and
``<out>.md``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from structlm.atomic import atomic_write_text
from structlm.bench.bandwidth import gemm_peak_gflops
from structlm.bench.timing import (
    environment,
    environment_line,
    interleaved_medians,
    write_csv_atomic,
)
from structlm.cpu_malloc import retain_freed_memory
from structlm.nn import AlgebraLinear
from structlm.nn.schedules import get_schedule
from structlm.ops.route import AlgebraCall, Backend, choose, force_layout

#: name -> (algebra, K, N, rows, sequence length, schedule)
CASES: dict[str, tuple[str, int, int, int, int, str]] = {
    "study-up": ("Q2^2", 256, 1024, 4096, 256, "block:32"),
    "study-down": ("Q2^2", 1024, 256, 4096, 256, "block:32"),
    "paper110m-up": ("Q2^2", 768, 3072, 1536, 1536, "block:192"),
    "paper110m-down": ("Q2^2", 3072, 768, 1536, 1536, "block:192"),
    "4096-cyclic": ("Q2^2", 4096, 4096, 2048, 2048, "cyclic"),
    "4096-block": ("Q2^2", 4096, 4096, 2048, 256, "block:32"),
    "study-up-Q4": ("Q4", 256, 1024, 4096, 256, "block:32"),
}
LAYOUTS = ("block-major", "diag-first", "output-major")


def time_case(name: str, trials: int) -> list[dict[str, object]]:
    """One row per (layout, mode) of case ``name``, F.linear's included."""
    algebra, k, n, m, seq, schedule = CASES[name]
    torch.manual_seed(0)
    layer = AlgebraLinear(k, n, algebra, backend="blocked")
    types = get_schedule(schedule, layer.q)(torch.arange(seq).repeat(m // seq))
    part = layer.partition(types)
    assert len(part.present) == layer.q, "every type occurs in the batch"
    x = torch.randn(m, k, requires_grad=True)
    gy = torch.randn(m, n)
    w = layer.weight
    rho = float(layer.mac_ratio(types))
    layouts = [lay for lay in LAYOUTS if lay != "block-major" or layer.plan.has_shared_blocks]
    chosen = {mode: choose(AlgebraCall(x.detach(), w if mode == "fwd+bwd" else w.detach(),
                                       layer.plan, part, Backend.BLOCKED)).route.value
              for mode in ("fwd", "fwd+bwd")}

    def dense_fwd() -> object:
        with torch.no_grad():
            return F.linear(x, w)

    def dense_both() -> object:
        return torch.autograd.grad(F.linear(x, w), [x, w], gy)

    def forced(layout: str, backward: bool) -> Callable[[], object]:
        def run() -> object:
            with force_layout(layout):
                if backward:
                    return torch.autograd.grad(layer(x, part), [x, w], gy)
                with torch.no_grad():
                    return layer(x, part)
        return run

    arms = {("F.linear", "fwd"): dense_fwd, ("F.linear", "fwd+bwd"): dense_both}
    for lay in layouts:
        arms[(lay, "fwd")] = forced(lay, False)
        arms[(lay, "fwd+bwd")] = forced(lay, True)
    times = dict(zip(arms, interleaved_medians(list(arms.values()), trials, warmup=1),
                     strict=True))
    env = {f"env_{key}": v for key, v in environment().items()}
    rows = []
    for (lay, mode), t in times.items():
        dense = times[("F.linear", mode)]
        passes = 1 if mode == "fwd" else 3  # fwd+bwd: the forward and the two gradients
        rows.append({"case": name, "algebra": algebra, "K": k, "N": n, "M": m,
                     "dense_gflops": round(2 * passes * m * k * n / dense / 1e9, 1),
                     "schedule": schedule, "mode": mode, "layout": lay,
                     "ms": round(t * 1e3, 3), "pct_of_ideal": round(100 * dense * rho / t, 1)
                     if lay != "F.linear" else "", "rho": round(rho, 4),
                     "route": chosen[mode], "trials": trials, **env})
    return rows


def markdown(rows: list[dict[str, object]]) -> str:
    """One line per case and mode: each layout's ms and share of the ideal."""
    lines = ["# The blocked layouts forced side by side", "",
             "`python benchmarks/layer_layouts.py` (2 threads, interleaved rounds, medians; "
             "% = F.linear ms × ρ / layout ms; **bold**: the route's choice)", "",
             "| case | algebra | K×N | M | schedule | mode | F.linear ms (GFLOP/s, % of "
             "GEMM) | " + " | ".join(LAYOUTS) + " |", "|---|---|---|---:|---|---|---:|"
             + "---:|" * len(LAYOUTS)]
    keys = list(dict.fromkeys((r["case"], r["mode"]) for r in rows))
    for case, mode in keys:
        sel = {r["layout"]: r for r in rows if r["case"] == case and r["mode"] == mode}
        r0 = sel["F.linear"]
        cells = []
        for lay in LAYOUTS:
            r = sel.get(lay)
            cell = "—" if r is None else f"{r['ms']:.2f} ({r['pct_of_ideal']:.0f}%)"
            cells.append(f"**{cell}**" if r is not None and r["route"] == lay else cell)
        peak = float(r0["gemm_peak_gflops"])
        lines.append(f"| {case} | {r0['algebra']} | {r0['K']}×{r0['N']} | {r0['M']} | "
                     f"{r0['schedule']} | {mode} | {r0['ms']:.2f} ({r0['dense_gflops']:.0f}, "
                     f"{100 * float(r0['dense_gflops']) / peak:.0f}%) | " + " | ".join(cells)
                     + " |")
    peaks = rows[0]["gemm_peak_before_after"]
    return "\n".join([*lines, "", f"GEMM rate (float32 1024³ `torch.mm`, median of 5) "
                       f"before / after the run: {peaks} GFLOP/s; the % column takes their "
                       "mean.", "", environment_line(rows), ""])  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    ap.add_argument("--out", default="bench-out/layer_layouts")
    args = ap.parse_args()
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: expected some of {list(CASES)}")
    retain_freed_memory()
    torch.set_num_threads(2)
    rows: list[dict[str, object]] = []
    before = gemm_peak_gflops()
    for name in names:
        rows += time_case(name, args.trials)
        print(name, " ".join(f"{r['layout']}/{r['mode']}: {r['ms']}" for r in rows
                             if r["case"] == name), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_csv_atomic(args.out + ".csv", rows)  # partial results survive a stop
    after = gemm_peak_gflops()
    for r in rows:
        r["gemm_peak_gflops"] = round((before + after) / 2, 1)
        r["gemm_peak_before_after"] = f"{before:.1f};{after:.1f}"
    write_csv_atomic(args.out + ".csv", rows)
    atomic_write_text(Path(args.out + ".md"), markdown(rows))


if __name__ == "__main__":
    main()
