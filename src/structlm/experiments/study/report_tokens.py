"""The study report's token and rate sections: the learning-rate sweep (validation),
test NLL per corpus part, how each pre-set gap moves from one token budget to the next,
and the loss-vs-tokens plot.

Gap rule (set before the runs): at each budget the gap ``a − b`` is
:func:`structlm.stats.compare`'s difference in mean test NLL with its 95% interval; whether
it moved between two budgets is the difference of differences, bootstrapped on its own by
:func:`gap_change` (paired by window, and by seed where an arm has the same seeds at both
budgets): "the gap fell" / "rose" only when its 95% interval excludes zero, else "no change
shown".
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats as sps

from structlm.experiments.study.config import StudyConfig, run_summary, validation_record
from structlm.plotting import save_figure
from structlm.stats import (
    BOOTSTRAP_REPLICATES,
    LEVEL,
    POWER,
    Arm,
    Comparison,
    UnequalBudgetError,
    UnpairedWindowsError,
    compare,
)

__all__ = ["GapChange", "gap_change", "part_lines", "plot_loss_vs_tokens", "sweep_lines",
           "sweep_table", "trend_lines"]


def sweep_table(cfg: StudyConfig) -> dict[str, dict[float, float | None]]:
    """Per swept arm: rate -> whole-split validation loss (``None`` while not run); the
    validation record only (:func:`~structlm.experiments.study.config.validation_record`)."""
    out: dict[str, dict[float, float | None]] = {}
    for r in cfg.sweep_runs():
        s = run_summary(cfg, r)
        out.setdefault(r.arm.name, {})[r.lr] = (
            None if s is None else validation_record(s, f"{r.arm.name} lr {r.lr:g}")["loss"])
    return out


def sweep_lines(cfg: StudyConfig, table: dict[str, dict[float, float | None]]) -> list[str]:
    """The sweep's table: loss per arm and rate, the chosen rate, and a warning where it
    sits at the edge of the grid (the best rate may lie outside it)."""
    if cfg.lr_sweep is None or not table:
        return []
    sw = cfg.lr_sweep
    rates = sorted(sw.rates)
    lines = [f"## Learning-rate sweep ({sw.budget} steps, seed {sw.seed})", "",
             "Each swept arm trains at every rate; the lowest whole-split **validation** "
             "loss picks its rate for every budget and seed (arms with `from:<arm>` take that "
             "arm's); the test text plays no part in it. "
             + ("The run at the chosen rate is reused as that arm's run at this budget and "
                "seed (it is scored on test then). " if sw.reuse else
                f"The sweep's seed ({sw.seed}) is none of the arms' seeds: no sweep run "
                "enters the verdicts (a run chosen for its low validation loss would carry "
                "its seed's luck onto the test text). ")
             + "One seed: a close call between rates is within seed noise.", "",
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
    """Test NLL per corpus part (mean [min–max] over seeds) and pooled (descriptive)."""
    parts = sorted({p for s in stats.values() for r in s["runs"] for p in r["test"]["parts"]})
    if len(parts) < 2:
        return []
    lines = ["Test NLL per corpus part (mean [min–max] over seeds; pooled = token-weighted "
             "over the parts; descriptive, the verdicts are on the pooled scores):", "",
             "| arm | " + " | ".join(parts) + " | pooled |",
             "|---|" + "---:|" * (len(parts) + 1)]
    for name, s in stats.items():
        cells = []
        for p in parts:
            v = [r["test"]["parts"][p]["mean_nll"] for r in s["runs"]
                 if p in r["test"]["parts"]]
            cells.append(f"{statistics.fmean(v):.4f} [{min(v):.4f}–{max(v):.4f}]" if v else "—")
        cells.append(f"{s['mean']:.4f} [{s['min']:.4f}–{s['max']:.4f}]")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    tokens = {p: r["test"]["parts"][p]["tokens"] for s in stats.values() for r in s["runs"]
              for p in r["test"]["parts"]}
    lines += ["", "Scored test tokens per part: " + ", ".join(
        f"{p} {t:,}" for p, t in sorted(tokens.items())) + ".", ""]
    return lines


@dataclass(frozen=True)
class GapChange:
    """How the gap ``a − b`` changed from a smaller to a larger budget:
    ``change = (M_a − M_b)[large] − (M_a − M_b)[small]`` nats per token, its interval."""

    a: str
    b: str
    budgets: tuple[int, int]
    """Steps of the smaller and the larger budget."""
    change: float
    lo: float
    hi: float
    se: float
    df: float
    detectable: float
    """The smallest |change| detected with 80% power (nats)."""
    paired_seeds: tuple[bool, bool]
    """Per arm, whether its runs were paired by seed across the budgets."""
    verdict: str
    """``"fell"``, ``"rose"``, ``"no change shown"`` or ``"no verdict: …"``."""

    def text(self) -> str:
        """``250→1000: −0.0123 [−0.0301, +0.0055]: no change shown (detectable ≈ …)``."""
        span = f"{self.budgets[0]}→{self.budgets[1]}"
        if self.verdict.startswith("no verdict"):
            return f"{span}: {self.change:+.4f}, {self.verdict}"
        head = f"{span}: {self.change:+.4f} [{self.lo:+.4f}, {self.hi:+.4f}]"
        if self.verdict in ("fell", "rose"):
            return f"{head}: **the gap {self.verdict}**"
        return f"{head}: no change shown (detectable ≈ {self.detectable:.4f})"


def _rows(arm: Arm) -> tuple[np.ndarray, np.ndarray]:
    """``(runs, W)`` per-token NLL per window, and the tokens per window."""
    toks = np.asarray(arm.runs[0].tokens, dtype=np.float64)
    return np.asarray([r.nll for r in arm.runs], dtype=np.float64) / toks, toks


def _resampled(rows: np.ndarray, B: int, rng: np.random.Generator) -> np.ndarray:
    """``(B, W)``: the mean over resampled units (rows), each replicate's deviations from
    the units' mean spread by ``sqrt(n/(n−1))`` (the unbiased ``s²/n``, as
    :func:`structlm.stats.compare` does)."""
    n = rows.shape[0]
    centre = rows.mean(0)
    if n < 2:
        return np.broadcast_to(centre, (B, rows.shape[1]))
    pick = rng.integers(0, n, size=(B, n))
    return centre + ((rows[pick] - centre) * math.sqrt(n / (n - 1))).mean(1)


def _run_parts(rows: np.ndarray, toks: np.ndarray) -> tuple[float, float]:
    """Variance of the mean over units and its degrees of freedom (``nan`` with one)."""
    means = rows @ toks / toks.sum()
    if len(means) < 2:
        return math.nan, 0.0
    return float(np.var(means, ddof=1)) / len(means), float(len(means) - 1)


def gap_change(a: tuple[Arm, Arm], b: tuple[Arm, Arm],
               seeds_a: tuple[Sequence[int], Sequence[int]],
               seeds_b: tuple[Sequence[int], Sequence[int]], level: float = LEVEL,
               replicates: int = BOOTSTRAP_REPLICATES, seed: int = 0) -> GapChange:
    """Did the gap ``a − b`` move between two budgets? ``a`` and ``b`` are each arm at the
    smaller and at the larger budget, ``seeds_*`` their runs' seeds in the same order.

    The statistic is the difference of differences
    ``Δ = (M_a − M_b)[large] − (M_a − M_b)[small]``, estimated and bootstrapped as one
    quantity rather than by asking whether the two gaps' intervals overlap: all four
    arms are scored on the same test windows, so a window's difficulty cancels in ``Δ``
    window by window, and the same seed at both budgets (the same initialisation and
    batch order) makes an arm's two runs correlated — an overlap rule ignores both and,
    for independent estimates, tests at about the 0.5% level instead of 5%: it would
    almost never see a real change. Each replicate resamples, per arm, its **seeds** with
    replacement — one seed carries its runs at both budgets together when the arm has the
    same seeds at both (``paired_seeds``; otherwise each budget's runs are resampled on
    their own) — with the spread correction of :func:`structlm.stats.compare`, then the
    **windows** (the same for all four arms). The interval is ``Δ ± t_ν · SE``, ``SE`` the
    bootstrap standard deviation and ``ν`` the Welch–Satterthwaite degrees of freedom of
    the seed and window components — the rule of :func:`structlm.stats.compare`. "fell" /
    "rose" only when the interval excludes zero. Arms of one budget must share their
    budget (:class:`~structlm.stats.UnequalBudgetError`); all four must have been scored
    on the same windows (:class:`~structlm.stats.UnpairedWindowsError`)."""
    arms = (*a, *b)
    for x, y in ((a[0], b[0]), (a[1], b[1])):
        if dict(x.budget) != dict(y.budget):
            raise UnequalBudgetError(f"{x.name!r} ({dict(x.budget)}) and {y.name!r} "
                                     f"({dict(y.budget)}) were trained under different "
                                     "budgets: no gap between them")
    if dict(a[0].budget) == dict(a[1].budget):
        raise ValueError(f"a change of the gap needs two budgets, got {dict(a[0].budget)} "
                         "twice")
    if len({x.windows for x in arms}) > 1 or len({x.runs[0].tokens for x in arms}) > 1:
        raise UnpairedWindowsError(f"{a[0].name!r} and {b[0].name!r} were not scored on the "
                                   "same windows at both budgets: no paired change")
    for arm, seeds in zip(arms, (*seeds_a, *seeds_b), strict=True):
        if len(seeds) != arm.n_runs:
            raise ValueError(f"arm {arm.name!r}: {len(seeds)} seeds for {arm.n_runs} runs")
    if replicates < 100:
        raise ValueError(f"replicates must be >= 100, got {replicates}")
    toks = np.asarray(a[0].runs[0].tokens, dtype=np.float64)
    W = len(toks)
    rng = np.random.default_rng(seed)
    win = rng.integers(0, W, size=(replicates, W))  # (B, W): one draw for all four arms
    tw = toks[win]  # (B, W)
    boot = np.zeros(replicates)
    per_window = np.zeros(W)  # the run-averaged Δ per window (per token)
    parts: list[tuple[float, float]] = []
    paired: list[bool] = []
    for sign, (small, large), (s_small, s_large) in ((1.0, a, seeds_a), (-1.0, b, seeds_b)):
        rs, _ = _rows(small)
        rl, _ = _rows(large)
        same = sorted(s_small) == sorted(s_large) and len(set(s_small)) == len(s_small)
        paired.append(same)
        if same:  # one unit per seed: its change from the smaller to the larger budget
            order = [list(s_small).index(k) for k in s_large]
            units = rl - rs[order]  # (n, W)
            rows = _resampled(units, replicates, rng)
            per_window += sign * units.mean(0)
            parts.append(_run_parts(units, toks))
        else:
            rows = _resampled(rl, replicates, rng) - _resampled(rs, replicates, rng)
            per_window += sign * (rl.mean(0) - rs.mean(0))
            parts += [_run_parts(rl, toks), _run_parts(rs, toks)]
        vals = np.take_along_axis(np.asarray(rows), win, axis=1)  # (B, W)
        boot += sign * (vals * tw).sum(1) / tw.sum(1)
    change = float(per_window @ toks / toks.sum())
    se = float(np.std(boot, ddof=1))
    vw = float(np.var(per_window * toks / toks.mean(), ddof=1)) / W if W > 1 else 0.0
    parts.append((vw, W - 1.0))
    if any(math.isnan(v) for v, _ in parts):
        return GapChange(a[0].name, b[0].name, (a[0].budget.get("steps"),
                                                a[1].budget.get("steps")), change, math.nan,
                         math.nan, se, 0.0, math.nan, (paired[0], paired[1]),
                         "no verdict: an arm has one run at a budget (no seed-to-seed "
                         "variance to compare against)")
    ok = [(v, d) for v, d in parts if v > 0 and d > 0]
    total = sum(v for v, _ in ok)
    denom = sum(v * v / d for v, d in ok)
    df = total * total / denom if denom > 0 else math.inf
    q = float(sps.t.ppf(0.5 + level / 2, df)) if math.isfinite(df) else \
        float(sps.norm.ppf(0.5 + level / 2))
    qp = float(sps.t.ppf(POWER, df)) if math.isfinite(df) else float(sps.norm.ppf(POWER))
    lo, hi = change - q * se, change + q * se
    verdict = "fell" if hi < 0 else "rose" if lo > 0 else "no change shown"
    return GapChange(a[0].name, b[0].name, (a[0].budget.get("steps"), a[1].budget.get("steps")),
                     change, lo, hi, se, df, (q + qp) * se, (paired[0], paired[1]), verdict)


def _gap_cell(c: Comparison) -> str:
    """``+0.0991 [+0.0512, +0.1470], b lower`` (the verdict of :func:`structlm.stats.compare`
    at that budget)."""
    if c.verdict.startswith("no verdict"):
        return f"{c.diff:+.4f}, no verdict (one run)"
    verdict = f"**{c.lower} lower**" if c.decided else "no difference shown"
    return f"{c.diff:+.4f} [{c.lo:+.4f}, {c.hi:+.4f}], {verdict}"


def trend_lines(cfg: StudyConfig, per_budget: dict[int, dict[str, dict[str, Any]]],
                pairs: list[tuple[str, str, str]]) -> list[str]:
    """Each pre-set comparison ``pairs`` (question, arm a, arm b) with its gap and 95%
    interval at every budget (:func:`structlm.stats.compare`) and whether it moved between
    consecutive budgets (:func:`gap_change`); budgets with every planned seed of both arms
    only."""
    budgets = sorted(per_budget)
    if len(cfg.all_budgets()) < 2:
        return []
    lines = ["", "## Gaps across token budgets", "",
             "Gap = a − b in mean test NLL per token (negative: a lower), with its 95% "
             "interval at each budget. Change = the gap at the larger budget minus the gap "
             "at the smaller, bootstrapped as one quantity (paired by window, and by seed "
             "where an arm has the same seeds at both budgets; the rule of "
             "structlm.stats.compare): \"the gap fell\" / \"rose\" only when its interval "
             "excludes zero. Only budgets with every planned seed of both arms count.", "",
             "| question | a | b | " + " | ".join(f"gap at {b} steps" for b in budgets)
             + " | change |", "|---|---|---|" + "---:|" * len(budgets) + "---|"]
    for i, (question, a, b) in enumerate(pairs):
        gaps: list[tuple[int, Any]] = []
        for steps in budgets:
            st = per_budget[steps]
            ok = (a in st and b in st and st[a]["n"] >= st[a]["planned"]
                  and st[b]["n"] >= st[b]["planned"])
            gaps.append((steps, compare(st[a]["scores"], st[b]["scores"], seed=i)
                         if ok else None))
        if not any(g for _, g in gaps):
            continue
        cells = [_gap_cell(g) if g else "—" for _, g in gaps]
        done = [s for s, g in gaps if g is not None]
        moves = []
        for s0, s1 in itertools.pairwise(done):
            x0, x1 = per_budget[s0], per_budget[s1]
            moves.append(gap_change((x0[a]["scores"], x1[a]["scores"]),
                                    (x0[b]["scores"], x1[b]["scores"]),
                                    (x0[a]["seeds"], x1[a]["seeds"]),
                                    (x0[b]["seeds"], x1[b]["seeds"]), seed=i).text())
        lines.append(f"| {question} | {a} | {b} | {' | '.join(cells)} | "
                     f"{'; '.join(moves) or 'one budget so far'} |")
    return lines


def plot_loss_vs_tokens(per_budget: dict[int, dict[str, dict[str, Any]]],
                        tokens_per_step: int, png: Path) -> None:
    """Mean test NLL against training tokens, one line per arm, the seed range as error
    bars."""
    from structlm.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(dict.fromkeys(n for st in per_budget.values() for n in st))
    for i, name in enumerate(names):
        pts = sorted((steps * tokens_per_step, st[name]) for steps, st in per_budget.items()
                     if name in st)
        xs = [x for x, _ in pts]
        mean = [s["mean"] for _, s in pts]
        err = [[max(0.0, s["mean"] - s["min"]) for _, s in pts],
               [max(0.0, s["max"] - s["mean"]) for _, s in pts]]
        dense = pts[0][1]["arm"].is_dense
        ax.errorbar(xs, mean, yerr=err, fmt="--s" if dense else "-o", color=f"C{i}",
                    capsize=3, ms=4, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("test NLL (nats/token; bars: seed range)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, png, dpi=120)
