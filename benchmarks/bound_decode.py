"""One algebra layer at ``M = 1`` with caches flushed: what the bound call saves, and the
floor that the bytes themselves set.

``python benchmarks/bound_decode.py [--k 4096 --n 4096] [--algebras Q2,Q4,...]``

Per algebra, interleaved in the same rounds, every call after a 512 MiB cache flush (as
in a decode step of a model larger than the last-level cache, so code and objects are
cold too):

* dense — the fastest of ``F.linear``, the dense few-row kernel called as a function,
  and the ``DecodeLinear`` module (bound call);
* algebra, bound — ``AlgebraLinear(x, part)`` as a decode step calls it (the bound
  compiled call, ``cpu_kernels.typed_rows_binding``);
* algebra, unbound — the same layer through its Python gate and wrapper (the path before
  the binding; ``force_layout("fused-rows")`` keeps the binding out of use);
* the bare kernel calls on the typed copy and on the panel-packed copy (which copy a
  single-type decode call should read);
* equal-bytes dense — the dense module on a weight with as many elements as the
  token's type reads (``N_eq = rho N`` rows): the time the memory system takes for
  those bytes in one call, so ``dense / equal-bytes`` is the best ratio any layout
  reading exactly the support could reach here; ``% of floor`` = the algebra's ratio
  over that.

Writes CSV (with the environment) and a Markdown table drawn from it.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from structlm.bench.timing import (
    CacheFlusher,
    environment_line,
    interleaved_medians,
    write_csv_and_markdown,
)
from structlm.cpu_malloc import retain_freed_memory
from structlm.nn import AlgebraLinear, DecodeLinear
from structlm.ops import cpu_kernels
from structlm.ops.partition import TypePartition
from structlm.ops.route import force_layout


def _dense(k: int, n: int) -> DecodeLinear:
    layer = DecodeLinear(k, n, bias=False).requires_grad_(False)
    with torch.no_grad():
        layer.weight.normal_(0, k ** -0.5)
    return layer


def time_algebra(algebra: str, k: int, n: int, type_index: int, trials: int,
                 flusher: CacheFlusher) -> dict[str, object]:
    layer = AlgebraLinear(k, n, algebra).requires_grad_(False)
    part = TypePartition(torch.tensor([type_index % layer.q]), layer.q)
    tables = cpu_kernels.block_tables(layer.plan)
    oo, io, uses = tables
    read = int((uses[part.present[0]].long() * torch.outer(oo.diff(), io.diff())).sum())
    if read % k:
        raise ValueError(f"{algebra}: the type reads {read} weights, not a multiple of K={k}")
    dense, equal = _dense(k, n), _dense(k, read // k)
    x = torch.randn(1, k)
    mod = cpu_kernels.kernel_for(x, layer.weight)
    typed = cpu_kernels.typed_weight(layer.weight, layer.plan)
    packed = cpu_kernels.packed_weight(layer.weight, layer.plan)
    types = part.types.long()

    def unbound() -> object:
        with force_layout("fused-rows"):
            return layer(x, part)

    fns = {"F.linear": lambda: F.linear(x, dense.weight),
           "dense-rows kernel": lambda: cpu_kernels.dense_rows_linear(x, dense.weight),
           "DecodeLinear": lambda: dense(x), "bound": lambda: layer(x, part),
           "unbound": unbound, "equal bytes": lambda: equal(x),
           "kernel typed": lambda: mod.typed_rows_forward(x, typed, types, *tables, layer.q,
                                                          None),
           "kernel panel": lambda: mod.fused_rows_forward(x, packed, types, *tables, layer.q,
                                                          None)}
    with torch.no_grad():
        for f in fns.values():
            f()  # binds the modules' calls
        assert "_rows_binding" in layer.__dict__ and "_rows_binding" in dense.__dict__
        t = dict(zip(fns, interleaved_medians(list(fns.values()), trials, warmup=2,
                                              before_each=flusher), strict=True))
    dense_path = min(("F.linear", "dense-rows kernel", "DecodeLinear"), key=t.__getitem__)
    ideal = float(1 / layer.mac_ratio(part.types))
    floor = t[dense_path] / t["equal bytes"]
    return {"algebra": algebra, "K": k, "N": n, "type": part.present[0],
            "weights_read": read, "dense_path": dense_path,
            "dense_ms": round(t[dense_path] * 1e3, 4),
            "bound_ms": round(t["bound"] * 1e3, 4), "unbound_ms": round(t["unbound"] * 1e3, 4),
            "equal_bytes_ms": round(t["equal bytes"] * 1e3, 4),
            "kernel_typed_ms": round(t["kernel typed"] * 1e3, 4),
            "kernel_panel_ms": round(t["kernel panel"] * 1e3, 4), "ideal": round(ideal, 4),
            "speedup_bound": round(t[dense_path] / t["bound"], 4),
            "speedup_unbound": round(t[dense_path] / t["unbound"], 4),
            "floor_speedup": round(floor, 4),
            "pct_ideal_bound": round(100 * t[dense_path] / t["bound"] / ideal, 1),
            "pct_floor_bound": round(100 * t["equal bytes"] / t["bound"], 1),
            "trials": trials}


def markdown(rows: list[dict[str, str]]) -> str:
    lines = [environment_line(rows), "",
             "| algebra | K×N | dense path | dense ms | bound ms | unbound ms | equal-bytes ms "
             "| speed-up bound | unbound | equal-bytes floor | ideal 1/ρ | % of ideal "
             "| % of floor | kernel typed ms | kernel panel ms |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['algebra']} | {r['K']}×{r['N']} | {r['dense_path']} | "
                     f"{r['dense_ms']} | {r['bound_ms']} | {r['unbound_ms']} | "
                     f"{r['equal_bytes_ms']} | {float(r['speedup_bound']):.2f}× | "
                     f"{float(r['speedup_unbound']):.2f}× | {float(r['floor_speedup']):.2f}× | "
                     f"{float(r['ideal']):.2f}× | {r['pct_ideal_bound']}% | "
                     f"{r['pct_floor_bound']}% | {r['kernel_typed_ms']} | "
                     f"{r['kernel_panel_ms']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--algebras", default="Q2,Q4,Q8,Q16,Q32,Q2^2")
    ap.add_argument("--type", type=int, default=1, help="position type of the token")
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/bound_decode_cpu")
    args = ap.parse_args(argv)
    if not cpu_kernels.fused_rows_available():
        print("the compiled rows kernel is not available: nothing to time", file=sys.stderr)
        return 1
    retain_freed_memory()  # as the structlm command runs
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    flusher = CacheFlusher()
    rows = []
    for alg in args.algebras.split(","):
        r = time_algebra(alg, args.k, args.n, args.type, args.trials, flusher)
        rows.append(r)
        print(f"{alg}: bound {r['speedup_bound']:.2f}x, unbound {r['speedup_unbound']:.2f}x, "
              f"equal-bytes floor {r['floor_speedup']:.2f}x, ideal {r['ideal']:.2f}x",
              flush=True)
    write_csv_and_markdown(args.out, rows, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
