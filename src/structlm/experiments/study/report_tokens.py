"""The study report's token and rate sections: the learning-rate sweep, losses per corpus
part, how each pre-set gap moves from one token budget to the next, and the loss-vs-tokens
plot.

Gap rule (set before the runs): at one budget the gap ``a − b`` between two arms lies in
``[min_a − max_b, max_a − min_b]`` (their seed ranges); between two budgets the gap moved
only when these intervals do not overlap, otherwise the report says no change is shown.
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

from structlm.experiments.study.config import StudyConfig, run_summary
from structlm.plotting import save_figure

__all__ = ["gap_interval", "part_lines", "plot_loss_vs_tokens", "sweep_lines", "sweep_table",
           "trend_lines"]


def sweep_table(cfg: StudyConfig) -> dict[str, dict[float, float | None]]:
    """Per swept arm: rate -> whole-split validation loss (``None`` while not run)."""
    out: dict[str, dict[float, float | None]] = {}
    for r in cfg.sweep_runs():
        s = run_summary(cfg, r)
        out.setdefault(r.arm.name, {})[r.lr] = None if s is None else s["val_loss"]
    return out


def sweep_lines(cfg: StudyConfig, table: dict[str, dict[float, float | None]]) -> list[str]:
    """The sweep's table: loss per arm and rate, the chosen rate, and a warning where it
    sits at the edge of the grid (the best rate may lie outside it)."""
    if cfg.lr_sweep is None or not table:
        return []
    sw = cfg.lr_sweep
    rates = sorted(sw.rates)
    lines = [f"## Learning-rate sweep ({sw.budget} steps, seed {sw.seed})", "",
             "Each swept arm trains at every rate; the lowest whole-split validation loss "
             "picks its rate for every budget and seed (arms with `from:<arm>` take that "
             "arm's). One seed: a close call between rates is within seed noise.", "",
             "| arm | " + " | ".join(f"lr {r:g}" for r in rates) + " | chosen | note |",
             "|---|" + "---:|" * len(rates) + "---:|---|"]
    for arm, by_rate in table.items():
        done = {r: v for r, v in by_rate.items() if v is not None}
        cells = [f"{by_rate[r]:.4f}" if by_rate.get(r) is not None else "—" for r in rates]
        if len(done) < len(rates):
            lines.append(f"| {arm} | {' | '.join(cells)} | — | sweep unfinished |")
            continue
        best = min(done.items(), key=lambda kv: (kv[1], kv[0]))[0]
        note = ("best at the grid's edge: a rate outside it may be better"
                if best in (rates[0], rates[-1]) else "")
        lines.append(f"| {arm} | {' | '.join(cells)} | {best:g} | {note} |")
    borrowed = [f"{a.name} ← {a.lr[5:]}" for a in cfg.arms
                if isinstance(a.lr, str) and a.lr.startswith("from:")]
    if borrowed:
        lines += ["", f"Rates taken from another arm: {', '.join(borrowed)}."]
    return [*lines, ""]


def part_lines(stats: dict[str, dict[str, Any]]) -> list[str]:
    """Validation loss per corpus part (mean and range over seeds) and pooled."""
    parts = sorted({p for s in stats.values() for r in s["runs"] for p in
                    (r.get("val_parts") or {})})
    if not parts:
        return []
    lines = ["Validation loss per corpus part (mean [min–max] over seeds; pooled = "
             "token-weighted over the parts):", "",
             "| arm | " + " | ".join(parts) + " | pooled |",
             "|---|" + "---:|" * (len(parts) + 1)]
    for name, s in stats.items():
        cells = []
        for p in parts:
            v = [r["val_parts"][p]["loss"] for r in s["runs"] if p in (r.get("val_parts") or {})]
            cells.append(f"{statistics.fmean(v):.4f} [{min(v):.4f}–{max(v):.4f}]" if v else "—")
        cells.append(f"{s['mean']:.4f} [{s['min']:.4f}–{s['max']:.4f}]")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    tokens = {p: r["val_parts"][p]["tokens"] for s in stats.values() for r in s["runs"]
              for p in (r.get("val_parts") or {})}
    lines += ["", "Scored tokens per part: " + ", ".join(f"{p} {t:,}" for p, t in
                                                         sorted(tokens.items())) + ".", ""]
    return lines


def gap_interval(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float, float]:
    """``(mean a − mean b, min_a − max_b, max_a − min_b)``: the gap and the interval its
    seed ranges allow."""
    return a["mean"] - b["mean"], a["min"] - b["max"], a["max"] - b["min"]


def _moved(small: tuple[float, float, float], large: tuple[float, float, float]) -> str:
    if large[2] < small[1]:
        return "fell"
    if large[1] > small[2]:
        return "rose"
    return "no change shown (intervals overlap)"


def trend_lines(cfg: StudyConfig, per_budget: dict[int, dict[str, dict[str, Any]]],
                pairs: list[tuple[str, str, str]]) -> list[str]:
    """Each pre-set comparison ``pairs`` (question, arm a, arm b) with its gap at every
    budget and whether it moved between consecutive budgets (the module's gap rule);
    complete seeds only."""
    budgets = sorted(per_budget)
    if len(cfg.all_budgets()) < 2:
        return []
    lines = ["", "## Gaps across token budgets", "",
             "Gap = a − b in validation loss (negative: a lower). Rule (set before the "
             "runs): a gap lies in [min_a − max_b, max_a − min_b] at one budget; between two "
             "budgets it moved only when those intervals do not overlap. Only budgets with "
             "every planned seed of both arms count.", "",
             "| question | a | b | " + " | ".join(f"{b} steps" for b in budgets)
             + " | change |", "|---|---|---|" + "---:|" * len(budgets) + "---|"]
    for question, a, b in pairs:
        gaps: list[tuple[int, tuple[float, float, float] | None]] = []
        for steps in budgets:
            st = per_budget[steps]
            ok = (a in st and b in st and st[a]["n"] == st[a]["planned"]
                  and st[b]["n"] == st[b]["planned"])
            gaps.append((steps, gap_interval(st[a], st[b]) if ok else None))
        if not any(g for _, g in gaps):
            continue
        cells = [f"{g[0]:+.4f} [{g[1]:+.4f}, {g[2]:+.4f}]" if g else "—" for _, g in gaps]
        done = [(s, g) for s, g in gaps if g is not None]
        moves = [f"{s0}→{s1}: {_moved(g0, g1)}"
                 for (s0, g0), (s1, g1) in itertools.pairwise(done)]
        lines.append(f"| {question} | {a} | {b} | {' | '.join(cells)} | "
                     f"{'; '.join(moves) or 'one budget so far'} |")
    return lines


def plot_loss_vs_tokens(per_budget: dict[int, dict[str, dict[str, Any]]],
                        tokens_per_step: int, png: Path) -> None:
    """Whole-split validation loss against training tokens, one line per arm, the seed
    range as error bars."""
    from structlm.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(dict.fromkeys(n for st in per_budget.values() for n in st))
    for i, name in enumerate(names):
        pts = sorted((steps * tokens_per_step, st[name]) for steps, st in per_budget.items()
                     if name in st)
        xs = [x for x, _ in pts]
        mean = [s["mean"] for _, s in pts]
        err = [[s["mean"] - s["min"] for _, s in pts], [s["max"] - s["mean"] for _, s in pts]]
        dense = pts[0][1]["arm"].is_dense
        ax.errorbar(xs, mean, yerr=err, fmt="--s" if dense else "-o", color=f"C{i}",
                    capsize=3, ms=4, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (whole split; bars: seed range)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, png, dpi=120)
