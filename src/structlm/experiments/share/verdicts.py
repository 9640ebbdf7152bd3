"""The verdicts of ``structlm experiment share``, every one through :mod:`structlm.stats`:
the arms of an entry become :class:`~structlm.stats.Arm` objects (their runs' per-window
NLLs on one text, strata = calibration draws, budget = what they were trained with) and
are compared paired by window.

* **after fine-tuning, at a budget**: :func:`structlm.stats.rank_arms` among the methods
  fine-tuned there (a winner only if its interval against every other method lies below
  zero; every pair's interval is printed);
* **before fine-tuning**: the analytic models (no seed: deterministic arms, the first
  calibration draw) compared the same way over the windows;
* **equal compute**: every pair of fine-tuned entries of different methods whose decoder
  MACs per token agree within :data:`EQUAL_MACS_TOLERANCE`;
* **test 5**: the share of the log-perplexity damage undone, per run, with a Student-t
  interval over runs against the pre-set 50%.

A run without per-window scores (recorded before they were kept) takes part in no
verdict, and arms trained under different budgets are never compared.
"""

from __future__ import annotations

import json
import math
from typing import Any

from structlm.stats import (
    Arm,
    Comparison,
    Ranking,
    UnequalBudgetError,
    WindowScores,
    compare,
    rank_arms,
    threshold_verdict,
)

__all__ = ["EQUAL_MACS_TOLERANCE", "RECOVERY_THRESHOLD", "analytic_arm", "equal_compute_pairs",
           "pair_rows", "ranking_text", "recovery_verdict", "tuned_arm"]

EQUAL_MACS_TOLERANCE = 0.01
"""Two entries are at equal compute when their MACs per token differ by at most 1%."""

RECOVERY_THRESHOLD = 0.5
"""Test 5 lives when fine-tuning undoes more than this share of the damage."""


def label(e: dict[str, Any]) -> str:
    """``method −20%`` (or the method alone in the seed regime)."""
    red = e.get("reduction")
    return e["method"] if red is None else f"{e['method']} −{red:.0%}"


def tuned_arm(e: dict[str, Any], text: str) -> Arm | str:
    """The entry's fine-tuned runs on ``text`` as an arm, or why there is none."""
    runs = [a for a in e["arms"] if "ppl_finetuned" in a]
    if not runs:
        return "not fine-tuned yet"
    scored = [a for a in runs if WindowScores.has_scores((a.get("eval_finetuned") or {})
                                                         .get(text))]
    if len(scored) < len(runs):
        return "runs without per-window scores (recorded before they were kept)"
    budgets = {json.dumps(a.get("budget"), sort_keys=True) for a in scored}
    if len(budgets) > 1:
        return f"its runs have different budgets ({sorted(budgets)})"
    strata = [str(a.get("calib_seed", 0)) for a in scored]
    return Arm(label(e), tuple(WindowScores.from_dict(a["eval_finetuned"][text])
                               for a in scored),
               budget=scored[0].get("budget") or {}, strata=tuple(strata)
               if len(set(strata)) > 1 else None)


def analytic_arm(e: dict[str, Any], text: str) -> Arm | str:
    """The entry's analytic model on the first calibration draw (deterministic)."""
    a = (e.get("analytic_arms") or e["arms"])[0]
    ev = (a.get("eval_analytic") or {}).get(text)
    if not WindowScores.has_scores(ev):
        return "no per-window scores"
    return Arm(label(e), (WindowScores.from_dict(ev),), budget={"steps": 0},
               deterministic=True)


def ranking_text(arms: list[Arm | str], names: list[str]) -> tuple[str, Ranking | None]:
    """The verdict line among ``arms`` (the reasons of those that cannot take part are
    named), and the ranking when at least two can."""
    ok = [a for a in arms if isinstance(a, Arm)]
    left = [f"{n}: {a}" for n, a in zip(names, arms, strict=True) if not isinstance(a, Arm)]
    tail = f" (not compared — {'; '.join(left)})" if left else ""
    if len(ok) < 2:
        return ("—" if not ok else f"only {ok[0].name} can be compared") + tail, None
    budgets = {json.dumps(dict(a.budget), sort_keys=True) for a in ok}
    if len(budgets) > 1:
        return ("no verdict: unequal budgets (" + "; ".join(
            f"{a.name} {dict(a.budget)}" for a in ok) + ")" + tail), None
    ranking = rank_arms(ok)
    return ranking.text() + tail, ranking


def pair_rows(pairs: list[Comparison]) -> list[str]:
    """Table rows ``| a − b | Δ nats [interval] | ppl ratio [interval] | verdict |``."""
    rows = []
    for c in pairs:
        r, lo, hi = c.ratio
        verdict = (f"{c.lower} lower" if c.decided else c.verdict)
        rows.append(f"| {c.a} − {c.b} | {c.n_runs[0]} / {c.n_runs[1]} | {c.diff:+.4f} "
                    f"[{c.lo:+.4f}, {c.hi:+.4f}] | ×{r:.3f} [{lo:.3f}–{hi:.3f}] | "
                    f"{'—' if math.isnan(c.detectable) else f'{c.detectable:.4f}'} | "
                    f"{verdict} |")
    return rows


PAIR_HEADER = ["| pair | runs | Δ mean NLL, nats [95%] | ppl ratio [95%] | detectable | "
               "verdict |", "|---|---|---|---|---:|---|"]
"""The header of :func:`pair_rows` (``detectable``: the smallest |Δ| the comparison would
find with 80% power)."""


def equal_compute_pairs(entries: list[dict[str, Any]], text: str
                        ) -> list[tuple[dict[str, Any], dict[str, Any], Comparison | str]]:
    """Every pair of fine-tuned whole-model entries of different methods at different
    reductions whose MACs per token agree within the tolerance, with its comparison (or
    why there is none)."""
    out = []
    tuned = [e for e in entries if any("ppl_finetuned" in a for a in e["arms"])]
    for i, x in enumerate(tuned):
        for y in tuned[i + 1:]:
            mx, my = (e["arms"][0].get("token_macs_ratio") for e in (x, y))
            if (x["method"] == y["method"] or x["reduction"] == y["reduction"] or not mx
                    or not my or abs(mx / my - 1) > EQUAL_MACS_TOLERANCE):
                continue
            ax, ay = tuned_arm(x, text), tuned_arm(y, text)
            if not isinstance(ax, Arm) or not isinstance(ay, Arm):
                why = ax if not isinstance(ax, Arm) else ay
                out.append((x, y, f"no verdict: {why}"))
                continue
            try:
                out.append((x, y, compare(ax, ay)))
            except UnequalBudgetError as err:
                out.append((x, y, f"no verdict: {err}"))
    return out


def recovery_verdict(e: dict[str, Any], original: float, text: str) -> str:
    """Test 5 on one entry: per run, the share of the log-perplexity damage undone,
    ``(log p_analytic − log p_tuned) / (log p_analytic − log p_original)``; "lives" when
    the Student-t interval over runs lies above 50%, "fails" when below."""
    runs = [((a.get("ppl_analytic") or e["analytic"])[text], a["ppl_finetuned"][text])
            for a in e["arms"] if "ppl_finetuned" in a]  # each run against its own draw
    if not runs:
        return "not fine-tuned yet"
    if min(math.log(an) - math.log(original) for an, _ in runs) <= 1e-9:
        return "no damage to repair"
    shares = [(math.log(an) - math.log(p)) / (math.log(an) - math.log(original))
              for an, p in runs]
    verdict, iv = threshold_verdict(shares, RECOVERY_THRESHOLD)
    word = {"above": "lives", "below": "fails", "undecided": "undecided",
            "too few draws": "too few runs"}[verdict]
    return f"{word} ({iv.text(2)})"
