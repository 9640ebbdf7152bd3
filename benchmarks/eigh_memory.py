"""Extra peak memory and time of a symmetric eigen-decomposition: ``torch.linalg.eigh``
against structlm's in-place ``symmetric_eigh_`` (LAPACK ``syevd`` through SciPy).

Usage::

    python benchmarks/eigh_memory.py --dims 2048,4096 --out benchmarks/results/eigh_memory

Each arm runs in a fresh process (so one arm's freed pages cannot hide the other's peak),
interleaved arm by arm for every dimension and repeat; a thread samples the resident set
every 5 ms. The extra peak is reported in units of ``dim²`` float64 (the size of the
matrix): the input itself is held by the caller in both arms and is not counted; the
in-place arm counts the copy it consumes (the symmetrised copy `psd_roots` makes).
Writes ``<out>.csv`` (with the environment) and prints a table of medians.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import sys, threading, time, torch
torch.set_num_threads(int(sys.argv[3]))
def rss():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
n, arm = int(sys.argv[1]), sys.argv[2]
g = torch.Generator().manual_seed(n)
X = torch.randn(n, n + 7, generator=g, dtype=torch.float64)
C = X @ X.T / n
del X
from structlm.hf.linalg import symmetric_eigh_
import scipy.linalg, threadpoolctl  # imported before the baseline: not counted
peak = [0]
time.sleep(0.1)
base = rss()
def sample():
    while True:
        peak[0] = max(peak[0], rss()); time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
t = time.perf_counter()
if arm == "torch":
    e, V = torch.linalg.eigh(C)
else:
    A = C.clone()  # the copy the caller makes to symmetrise; consumed, counted as extra
    e, V = symmetric_eigh_(A)
    del A
seconds = time.perf_counter() - t
time.sleep(0.05)
print((peak[0] - base) / (n * n * 8), seconds)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="2048,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/eigh_memory")
    args = ap.parse_args()
    import torch

    rows = []
    for n in [int(d) for d in args.dims.split(",")]:
        for r in range(args.repeats):
            for arm in ("torch", "symmetric_eigh_"):
                res = subprocess.run([sys.executable, "-c", CHILD, str(n), arm,
                                      str(args.threads)], capture_output=True, text=True,
                                     check=True)
                extra, seconds = map(float, res.stdout.split())
                rows.append({"dim": n, "arm": arm, "repeat": r, "extra_peak_dim2": extra,
                             "seconds": seconds, "threads": args.threads,
                             "cpu": platform.processor() or platform.machine(),
                             "torch": torch.__version__,
                             "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"{'dim':>6} {'arm':>16} {'extra peak (dim²)':>18} {'seconds':>8}  (medians)")
    for n in sorted({r["dim"] for r in rows}):
        for arm in ("torch", "symmetric_eigh_"):
            sel = [r for r in rows if r["dim"] == n and r["arm"] == arm]
            print(f"{n:>6} {arm:>16} {statistics.median(r['extra_peak_dim2'] for r in sel):>18.2f}"
                  f" {statistics.median(r['seconds'] for r in sel):>8.1f}")
    print(f"wrote {out.with_suffix('.csv')} ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
