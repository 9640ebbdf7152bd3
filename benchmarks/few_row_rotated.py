"""The few-row panel kernel with cold weights: dense and algebra rows, the weights rotated.

``python benchmarks/few_row_rotated.py --label NAME [--trials 15] [--out PREFIX]``

Rows, bare compiled calls on 4096x4096 weights, 2 threads: the dense panel-packed kernel
(``fused_rows_forward`` with the one-group support) at M = 8, 16, 32, 64, and the
algebra layers' fused-rows kernel on rows of every type (cyclic) for `Q2^2` at M = 32 and
`Q4` at M = 64. Each arm cycles over its own copies (9 dense, 5 per algebra), so between
two reads of one copy well over 1 GiB of other weights passes through the caches (cold
weights, warm code, as in a decode step); interleaved rounds, medians.

To compare two builds of the kernels (e.g. a change to ``ops/csrc``), run this script
alternately from each checkout (``PYTHONPATH=<checkout>/src``), each with its ``--label``,
several times: the machine drifts between minutes, so only alternated runs compare.
Appends one row per arm to ``<out>.csv`` (with the environment) and redraws ``<out>.md``.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from structlm.atomic import atomic_write_text
from structlm.bench.timing import (
    environment,
    environment_line,
    interleaved_medians,
    read_csv_rows,
    write_csv_atomic,
)
from structlm.cpu_malloc import retain_freed_memory
from structlm.nn import AlgebraLinear
from structlm.ops import cpu_kernels
from structlm.ops.partition import TypePartition

K = N = 4096
DENSE_MS = (8, 16, 32, 64)
ALGEBRA_ROWS = (("Q2^2", 32), ("Q4", 64))


def arms(dense_copies: int, algebra_copies: int) -> dict[str, object]:
    """Name -> a call that reads its next cold copy."""
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(N, K, generator=gen) for _ in range(dense_copies)]
    packs = [cpu_kernels.dense_packed_weight(w) for w in ws]
    tables = cpu_kernels.dense_tables(N, K)
    mod = cpu_kernels.extension()
    out: dict[str, object] = {}
    for m in DENSE_MS:
        x, types = torch.randn(m, K, generator=gen), torch.zeros(m, dtype=torch.int64)
        nxt = itertools.cycle(range(dense_copies))

        def dense(x=x, types=types, nxt=nxt) -> None:
            mod.fused_rows_forward(x, packs[next(nxt)], types, *tables, 1, None)

        out[f"dense M={m}"] = dense
    for alg, m in ALGEBRA_ROWS:
        layers = [AlgebraLinear(K, N, alg).requires_grad_(False) for _ in range(algebra_copies)]
        q = layers[0].plan.q
        part = TypePartition(torch.arange(m) % q, q)
        x = torch.randn(m, K, generator=gen)
        nxt = itertools.cycle(range(algebra_copies))

        def algebra(x=x, part=part, layers=layers, nxt=nxt) -> None:
            lay = layers[next(nxt)]
            cpu_kernels.fused_rows_linear(x, lay.weight, lay.plan, part)

        out[f"{alg} M={m}"] = algebra
    return out


def markdown(rows: list[dict[str, str]]) -> str:
    """Runs (one column each, in order) against arms (rows), ms."""
    runs = list(dict.fromkeys(r["run"] for r in rows))
    labels = {r["run"]: r["label"] for r in rows}
    names = list(dict.fromkeys(r["arm"] for r in rows))
    ms = {(r["run"], r["arm"]): float(r["ms"]) for r in rows}
    lines = ["# Few-row kernels, weights rotated (ms, medians)", "",
             "`python benchmarks/few_row_rotated.py --label NAME`, builds alternated", "",
             "| arm | " + " | ".join(f"{labels[r]} ({i + 1})" for i, r in enumerate(runs)) + " |",
             "|---|" + "---:|" * len(runs)]
    lines += [f"| {a} | " + " | ".join(f"{ms[(r, a)]:.2f}" if (r, a) in ms else "—"
                                        for r in runs) + " |" for a in names]
    return "\n".join([*lines, "", environment_line(rows), ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True, help="the build's name in the table")
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--out", default="bench-out/few_row_rotated")
    args = ap.parse_args()
    if not cpu_kernels.fused_rows_available():
        raise SystemExit("the compiled rows kernel is not available: nothing to time")
    retain_freed_memory()
    torch.set_num_threads(2)
    fns = arms(dense_copies=9, algebra_copies=5)
    times = interleaved_medians(list(fns.values()), args.trials, warmup=9)
    csv_path = Path(args.out + ".csv")
    old = read_csv_rows(str(csv_path)) if csv_path.exists() else []
    run = 1 + max((int(r["run"]) for r in old), default=0)
    env = {f"env_{k}": v for k, v in environment().items()}
    new = [{"run": run, "label": args.label, "arm": a, "ms": round(t * 1e3, 4), **env}
           for a, t in zip(fns, times, strict=True)]
    print(" ".join(f"{r['arm']}: {r['ms']:.2f}" for r in new))
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(str(csv_path), [*old, *new])
    atomic_write_text(Path(args.out + ".md"), markdown(read_csv_rows(str(csv_path))))


if __name__ == "__main__":
    main()
