"""A Markdown table from `structlm convert` reports (``structlm_convert.json`` files).

    python benchmarks/convert_reports_table.py A.json B.json ... [--out TABLE.md]

One row per report: the arm (init, permutation, distillation and healing steps), the
perplexity per evaluated text after the change, after distillation and after healing,
the mean relative layer error of the copy and of the fit on held-out calibration
windows (calibrated arms), and the command's seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def _arm(rep: dict[str, Any]) -> str:
    conv, cfg = rep["conversion"], rep["config"]
    parts = [f"{conv['algebra']} {conv['targets']}", conv.get("init", "copy")]
    if conv.get("groups") == "heads":
        parts.append("head groups")
    if conv.get("permute"):
        parts.append("permuted")
    if cfg.get("distill", {}).get("steps"):
        parts.append(f"distilled {cfg['distill']['steps']}")
    if cfg.get("heal", {}).get("steps"):
        parts.append(f"healed {cfg['heal']['steps']}")
    return ", ".join(parts)


def _layer_error(rep: dict[str, Any]) -> str:
    mods = (rep["conversion"].get("calibration") or {}).get("modules") or {}
    held = [m["held_out"] for m in mods.values() if "held_out" in m]
    if not held:
        return "—"
    return (f"{statistics.mean(h['copy'] for h in held):.3f} → "
            f"{statistics.mean(h['calibrated'] for h in held):.3f}")


def table(reports: list[tuple[str, dict[str, Any]]]) -> str:
    texts = list(reports[0][1]["original"].get("ppl", {}))
    head = ["arm", *[f"{t}: original → changed → distilled → healed" for t in texts],
            "held-out layer error (copy → fit)", "seconds", "report"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for path, rep in reports:
        cells = [_arm(rep)]
        for t in texts:
            steps = [rep["original"]["ppl"][t], rep["converted"]["ppl"][t],
                     rep["converted"].get("ppl_distilled", {}).get(t),
                     rep["converted"].get("ppl_healed", {}).get(t)]
            cells.append(" → ".join("—" if v is None else f"{v:,.1f}" for v in steps))
        cells += [_layer_error(rep), f"{rep['seconds']:.0f}", f"[{Path(path).name}]({path})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="structlm_convert.json files")
    ap.add_argument("--out", default="", help="write the table here too")
    args = ap.parse_args()
    reports = [(p, json.loads(Path(p).read_text())) for p in args.reports]
    text = table(reports)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
