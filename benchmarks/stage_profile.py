"""Where a large-batch ``Q_q`` forward spends its time: the diag-first layout's two stages
timed apart, each as GMAC/s beside the dense GEMM of the same run.

``python benchmarks/stage_profile.py [--m 2048] [--k 4096] [--algebras Q4,Q8,Q16,Q32]``

For ``Q_q`` (every type reads the diagonal blocks and its own input group's row of
blocks) the layout computes

* the **diagonal stage** — every row against the q diagonal blocks: one batched GEMM of
  q products ``(M, K/q) x (K/q, N/q)``;
* the **type stage** — per type, its ``M/q`` rows' own input group against the rest of
  that group's row of blocks: GEMMs of ``(M/q, K/q) x (K/q, N - N/q)`` accumulated into
  the output (here timed as one ``addmm_`` per type into strided output rows, as the
  layout does for a cyclic schedule).

The layer's forward is their sum plus bookkeeping; the ideal ratio assumes both run at
the dense GEMM's rate. Interleaved rounds, medians; CSV with the environment and a
Markdown table drawn from it.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from structlm.bench.timing import (
    environment_line,
    interleaved_medians,
    write_csv_and_markdown,
)
from structlm.nn import AlgebraLinear


def profile(alg: str, m: int, k: int, trials: int) -> dict[str, object]:
    layer = AlgebraLinear(k, k, alg, backend="blocked").requires_grad_(False)
    q = layer.q
    if q < 2 or m % q or k % q or not layer.plan.diag_plus_row:
        raise ValueError(f"{alg}: a Q_q algebra with q dividing M={m} and K={k} is expected")
    s = k // q
    w = layer.weight.detach()
    x = torch.randn(m, k)
    part = layer.partition(torch.arange(m) % q)
    y = torch.empty(m, k)
    w_diag = torch.stack([w[i * s:(i + 1) * s, i * s:(i + 1) * s] for i in range(q)])
    x_groups = x.view(m, q, s).transpose(0, 1)  # (q, M, s)
    # type a's row of blocks without its diagonal block: outputs of every other group
    rest = [torch.cat([w[:a * s, a * s:(a + 1) * s], w[(a + 1) * s:, a * s:(a + 1) * s]])
            for a in range(q)]  # (N - s, s)

    def diagonal() -> object:
        return torch.bmm(x_groups, w_diag.transpose(1, 2))

    def type_stage() -> object:
        for a in range(q):
            rows = y[a::q, : k - s]  # strided output rows of type a
            rows.addmm_(x[a::q, a * s:(a + 1) * s], rest[a].t())
        return y

    fns = {"dense": lambda: F.linear(x, w), "diagonal": diagonal, "type": type_stage,
           "layer": lambda: layer(x, part)}
    with torch.no_grad():
        t = dict(zip(fns, interleaved_medians(list(fns.values()), trials, warmup=1),
                     strict=True))
    macs = {"dense": m * k * k, "diagonal": m * k * s, "type": m * s * (k - s),
            "layer": m * k * s + m * s * (k - s)}
    row: dict[str, object] = {"algebra": alg, "M": m, "K": k, "N": k, "trials": trials}
    for name, sec in t.items():
        row[f"{name}_ms"] = round(sec * 1e3, 3)
        row[f"{name}_gmacs"] = round(macs[name] / sec / 1e9, 2)
    row["ideal"] = round(macs["dense"] / macs["layer"], 4)
    row["speedup"] = round(t["dense"] / t["layer"], 4)
    return row


def markdown(rows: list[dict[str, str]]) -> str:
    lines = [environment_line(rows), "",
             "| algebra | M | K×N | dense GMAC/s | diagonal stage GMAC/s | type stage GMAC/s "
             "| layer GMAC/s | layer ms (diag + type ms) | speed-up | ideal |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['algebra']} | {r['M']} | {r['K']}×{r['N']} | {r['dense_gmacs']} | "
                     f"{r['diagonal_gmacs']} | {r['type_gmacs']} | {r['layer_gmacs']} | "
                     f"{r['layer_ms']} ({r['diagonal_ms']} + {r['type_ms']}) | "
                     f"{float(r['speedup']):.2f}× | {float(r['ideal']):.2f}× |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--algebras", default="Q4,Q8,Q16,Q32")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/stage_profile_cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for alg in args.algebras.split(","):
        r = profile(alg, args.m, args.k, args.trials)
        rows.append(r)
        print(f"{alg}: dense {r['dense_gmacs']} GMAC/s, diagonal {r['diagonal_gmacs']}, "
              f"type {r['type_gmacs']}, layer {r['layer_gmacs']} ({r['speedup']}x of "
              f"{r['ideal']}x)", flush=True)
    write_csv_and_markdown(args.out, rows, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
