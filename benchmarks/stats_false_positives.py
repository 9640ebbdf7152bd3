"""The false-positive rate of structlm's verdict rules, measured by A/A simulation.

Usage: ``python benchmarks/stats_false_positives.py --out benchmarks/results/stats_false_positives``

For each design (runs per arm, calibration draws as strata, the size of the run-to-run and
run × window variation), ``structlm.stats.aa_false_positive_rate`` draws both arms from the
same distribution many times and counts how often ``compare`` declares a difference; beside
it, the rule the module replaced ("the two arms' ranges do not overlap") on the same
design. The threshold rule over calibration draws (``threshold_verdict``) is measured with
the true mean exactly at the threshold. Writes ``fpr.csv`` and ``fpr.md``.
"""

from __future__ import annotations

import argparse
import csv
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from structlm.stats import aa_false_positive_rate, threshold_verdict

DESIGNS = [  # (runs a, runs b, strata, run sd, run x window sd)
    (2, 2, 1, 0.05, 0.005),
    (2, 3, 1, 0.05, 0.005),
    (3, 3, 1, 0.05, 0.005),
    (3, 3, 1, 0.03, 0.02),
    (3, 3, 2, 0.05, 0.005),
    (5, 5, 1, 0.01, 0.05),
]


def range_rule_rate(n_a: int, n_b: int, trials: int, seed: int) -> float:
    """The old rule on arm means: a difference when one arm's range of run values lies
    below the other's (runs i.i.d. normal: the rule's rate does not depend on the sd)."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((trials, n_a)), rng.standard_normal((trials, n_b))
    return float(np.mean((a.max(1) < b.min(1)) | (b.max(1) < a.min(1))))


def threshold_rate(n: int, trials: int, seed: int, sd: float = 0.05) -> float:
    """``threshold_verdict`` declaring "above" or "below" when the true mean is exactly at
    the threshold (0.5), ``n`` draws with standard deviation ``sd``."""
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(trials):
        verdict, _ = threshold_verdict(list(0.5 + sd * rng.standard_normal(n)), 0.5)
        hits += verdict in ("above", "below")
    return hits / trials


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--trials", type=int, default=5000)
    ap.add_argument("--windows", type=int, default=33)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.time()
    for i, (na, nb, strata, run_sd, noise_sd) in enumerate(DESIGNS):
        fpr = aa_false_positive_rate(na, nb, n_windows=args.windows, trials=args.trials,
                                     run_sd=run_sd, window_sd=0.4, noise_sd=noise_sd,
                                     strata=strata, replicates=500, seed=1000 + i)
        old = range_rule_rate(na * strata, nb * strata, 200_000, seed=i)
        rows.append({"rule": "compare (paired, hierarchical bootstrap)", "runs_a": na,
                     "runs_b": nb, "strata": strata, "run_sd": run_sd, "run_x_window_sd":
                     noise_sd, "trials": args.trials, "false_positive_rate": fpr,
                     "old_range_rule_rate": old})
        print(rows[-1], flush=True)
    for n in (3, 5):
        rows.append({"rule": "threshold_verdict (Student t over draws)", "runs_a": n,
                     "runs_b": 0, "strata": 1, "run_sd": 0.05, "run_x_window_sd": 0,
                     "trials": 20000, "false_positive_rate": threshold_rate(n, 20000, n),
                     "old_range_rule_rate": float("nan")})
        print(rows[-1], flush=True)
    env = (f"python {platform.python_version()}, numpy {np.__version__}, "
           f"{platform.machine()}, {time.time() - t0:.0f} s")
    with open(out / "fpr.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=[*rows[0], "environment"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, "environment": env})
    lines = ["# False-positive rates of the verdict rules (A/A simulation)", "",
             f"`python benchmarks/stats_false_positives.py --out {args.out}` ({env}). "
             f"Per trial both arms come from one distribution: per-window difficulty "
             f"(Student t, 4 df, scale 0.4 nats) shared by both arms, a per-run offset "
             f"(run sd) and a run × window term; {args.windows} windows of 255 tokens; with "
             "2 strata each stratum (a calibration draw) adds an offset shared by both "
             "arms. The old rule: the two arms' run ranges do not overlap.", "",
             "| rule | runs | strata | run sd | run × window sd | trials | false positives "
             "| old range rule |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        runs = (f"{r['runs_a']} vs {r['runs_b']}" if r["runs_b"] else f"{r['runs_a']} draws")
        old = ("—" if np.isnan(r["old_range_rule_rate"])
               else f"{100 * r['old_range_rule_rate']:.1f}%")
        lines.append(f"| {r['rule']} | {runs} | {r['strata']} | {r['run_sd']} | "
                     f"{r['run_x_window_sd']} | {r['trials']} | "
                     f"{100 * r['false_positive_rate']:.1f}% | {old} |")
    (out / "fpr.md").write_text("\n".join(lines) + "\n")
    print(f"{out / 'fpr.md'} written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
