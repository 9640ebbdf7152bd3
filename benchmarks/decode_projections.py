"""Decode-step FFN projections at ``M = 1``: dense vs every blocked layout, weights from DRAM.

``python benchmarks/decode_projections.py [--preset paper-110m] [--algebra Q2^2]``

Times all of a preset's FFN projections (gate, up, down for every layer: 36 distinct
weights for paper-110m, 170 MB in fp32, so each call streams its weight from memory
as in a real decode step) for one token, per arm: dense ``F.linear`` (MKL), dense on
the compiled rows kernel (what the model's dense layers run at decode), the algebra on
the same kernel from its typed copies (what a decode step runs) and from its
block-packed copy (rows of mixed types), each called straight with prebuilt arguments
as the model's one-call decode step does, and the blocked backend's PyTorch layouts
forced through the layer. Ratios are against the *fastest* dense arm. Interleaved
rounds, medians; writes CSV (with the environment), a markdown table and a bar chart
drawn from the CSV.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from structlm.bench.timing import environment, interleaved_medians, write_csv_atomic
from structlm.models import config_from_preset
from structlm.nn import AlgebraLinear
from structlm.ops import cpu_extension, cpu_kernels
from structlm.ops.route import force_layout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="paper-110m")
    ap.add_argument("--algebra", default="Q2^2")
    ap.add_argument("--type", type=int, default=1, help="position type of the token")
    ap.add_argument("--layouts", default="output-major,diag-first",
                    help="PyTorch blocked layouts to time through the layer (comma-separated)")
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/decode_projections_cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = config_from_preset(args.preset, algebra=args.algebra)
    d, f = cfg.hidden_size, cfg.intermediate_size
    shapes = [(d, f), (d, f), (f, d)] * cfg.num_hidden_layers  # (in, out): gate, up, down
    layers = [AlgebraLinear(k, n, args.algebra, bias=False).requires_grad_(False)
              for k, n in shapes]
    dense = [torch.randn(n, k) / k**0.5 for k, n in shapes]
    xs = {k: torch.randn(1, k) for k in {d, f}}
    types = torch.tensor([args.type])
    parts = {id(layer): layer.partition(types) for layer in layers}

    def run_dense() -> None:
        for w in dense:
            F.linear(xs[w.shape[1]], w)

    kernels = cpu_kernels.fused_rows_available()
    mod = cpu_extension.extension() if kernels else None

    def run_dense_kernel() -> None:
        for w in dense:
            mod.dense_rows_forward(xs[w.shape[1]], w, None)

    def kernel_args(copy: str) -> list[tuple]:
        make = cpu_kernels.typed_weight if copy == "typed" else cpu_kernels.packed_weight
        return [(xs[layer.in_features], make(layer.weight, layer.plan), types,
                 *cpu_kernels.block_tables(layer.plan), layer.q, None) for layer in layers]

    def run_copy(copy: str):
        fn = mod.typed_rows_forward if copy == "typed" else mod.fused_rows_forward
        calls = kernel_args(copy)

        def run() -> None:
            for call in calls:
                fn(*call)
        return run

    def run_layout(name: str):
        def run() -> None:
            with force_layout(name):
                for layer in layers:
                    layer(xs[layer.in_features], parts[id(layer)])
        return run

    layouts = [name for name in args.layouts.split(",") if name]
    dense_arms = ["F.linear", "rows-kernel"] if kernels else ["F.linear"]
    algebra_arms = (["rows-kernel typed copy", "rows-kernel block copy"] if kernels else [])
    algebra_arms += layouts
    fns = [run_dense, run_dense_kernel][:len(dense_arms)]
    if kernels:
        fns += [run_copy("typed"), run_copy("blocks")]
    fns += [run_layout(n) for n in layouts]
    with torch.no_grad():
        for fn in fns:  # first calls: weight copies are made here
            fn()
        medians = interleaved_medians(fns, trials=args.trials, warmup=1)
    env = environment()
    weight_mb = sum(w.numel() for w in dense) * 4 / 1e6
    rows = []
    best_dense = min(medians[:len(dense_arms)])
    for i, (name, sec) in enumerate(zip([*dense_arms, *algebra_arms], medians, strict=True)):
        rows.append({"preset": args.preset,
                     "algebra": "dense" if i < len(dense_arms) else args.algebra,
                     "layout": name, "projections": len(shapes), "dense_weight_mb": weight_mb,
                     "ms": round(sec * 1e3, 3), "speedup_vs_dense": round(best_dense / sec, 3),
                     **env})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(f"{out}.csv", rows)
    lines = [f"Environment: {env}", "",
             f"{len(shapes)} FFN projections of `{args.preset}` at M = 1 (type {args.type}), "
             f"{weight_mb:.0f} MB of dense fp32 weights, {args.trials} interleaved rounds, "
             "medians; speed-up against the fastest dense arm.", "",
             "| arm | ms for all projections | speed-up vs dense |", "|---|---:|---:|"]
    lines += [f"| {r['algebra']} {r['layout']} | {r['ms']:.2f} | {r['speedup_vs_dense']:.3f}× |"
              for r in rows]
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(f"{out}.csv", f"{out}.png")
    return 0


def _plot(csv_path: str, png_path: str) -> None:
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as fh:
        rows = list(csv.DictReader(fh))
    fig, ax = plt.subplots(figsize=(6, 3))
    names = [f"{r['algebra']}\n{r['layout']}" for r in rows]
    ax.bar(names, [float(r["ms"]) for r in rows],
           color=["grey" if r["algebra"] == "dense" else "C0" for r in rows])
    ax.set_ylabel("ms per decode step (all FFN projections)")
    ax.set_title(f"{rows[0]['preset']}: FFN projections at M = 1 ({rows[0]['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
