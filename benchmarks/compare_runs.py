"""Speed-ups of the same benchmark rows across runs (e.g. two code versions on one machine).

    python benchmarks/compare_runs.py --label old=a.csv --label new=b.csv [--label old=c.csv]

Reads the CSVs ``structlm bench layer | generate | train`` write, matches rows on their
configuration columns and prints one Markdown table: each run's speed-up over its own
dense arm (measured in the same interleaved trials), the spread of the runs of one label
and of all runs. Only ratios within a run are compared: absolute times drift between
minutes on a shared VM.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict

KEYS = {  # configuration columns per benchmark kind, and the speed-up column
    "layer": (("mode", "M", "K", "N", "algebra", "schedule", "kind"), "speedup"),
    "generate": (("mode", "model", "algebra"), "speedup_vs_dense"),
    "train": (("preset", "algebra", "type_schedule", "seq_len", "batch_size"), "speedup"),
}


def _kind(header: list[str]) -> str:
    if "speedup_vs_dense" in header:
        return "generate"
    return "train" if "tokens_per_step" in header else "layer"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", action="append", required=True, help="LABEL=path.csv")
    a = p.parse_args()
    runs = [tuple(item.split("=", 1)) for item in a.label]
    table: dict[tuple, list[tuple[str, float]]] = defaultdict(list)
    for label, path in runs:
        with open(path) as fh:
            rows = list(csv.DictReader(fh))
        keys, col = KEYS[_kind(list(rows[0]))]
        for r in rows:
            if r.get("model") == "dense":
                continue
            table[tuple(r.get(k, "") for k in keys)].append((label, float(r[col])))
    names = [f"{lab} #{i + 1}" for i, (lab, _) in enumerate(runs)]
    print("| row | " + " | ".join(names) + " | spread within a label | new / old (means) |")
    print("|---|" + "---:|" * (len(names) + 2))
    for key, vals in table.items():
        by: dict[str, list[float]] = defaultdict(list)
        for lab, v in vals:
            by[lab].append(v)
        spread = max((max(v) - min(v)) / min(v) for v in by.values())
        means = {lab: sum(v) / len(v) for lab, v in by.items()}
        ratio = (f"{means['new'] / means['old']:.3f}" if {"new", "old"} <= set(means)
                 else "")
        cells = [f"{v:.3f}×" for _, v in vals]
        print(f"| {' '.join(k for k in key if k)} | " + " | ".join(cells)
              + f" | {spread:.1%} | {ratio} |")


if __name__ == "__main__":
    main()
