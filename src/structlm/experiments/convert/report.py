"""Report of ``structlm experiment convert``: ``report.md`` (one table per target, verdicts per
budget and text by a pre-set rule, the healing curves' last steps), ``ppl_vs_macs.png``
and ``healing_curves.png``."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from structlm.atomic import atomic_write_text
from structlm.experiments.convert.breakdown import breakdown_lines, plot_breakdown
from structlm.plotting import save_figure
from structlm.stats import Arm, UnequalBudgetError, WindowScores, compare

__all__ = ["plateau", "verdict", "write_convert_report"]

RULE = ("Verdicts (structlm.stats): at one MAC budget and on one text, two arms' seeds "
        "are compared paired by test window — the difference in mean NLL with a 95% "
        "hierarchical-bootstrap interval over seeds, then windows; one arm is better only "
        "when the interval excludes zero, otherwise no difference is shown. Arms trained "
        "under different budgets (the `+distill` variants' extra steps) are not compared; "
        "runs recorded without per-window scores take part in no verdict.")


def _group(arms: list[dict[str, Any]]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for a in arms:
        out.setdefault((a["target"], a["arm"], a["budget"]), []).append(a)
    return out


def _pairs(groups: dict[tuple[str, str, str], list[dict[str, Any]]], target: str, budget: str
           ) -> list[tuple[str, list[dict[str, Any]], str, list[dict[str, Any]]]]:
    """The comparisons at one budget: every algebra arm against every baseline and the
    dense control, the baselines against each other, and each algebra variant against
    the one before it (what each step of the start adds)."""
    def of(kinds: tuple[str, ...], budgets: tuple[str, ...]) -> list[tuple[str, Any]]:
        return [(k[1], v) for k, v in groups.items()
                if k[0] == target and k[2] in budgets and v[0]["kind"] in kinds]

    algebra = of(("algebra",), (budget,))
    others = of(("prune", "svd"), (budget,))
    dense = of(("dense",), ("",))
    pairs = [(*a, *b) for a in algebra for b in others + dense]
    pairs += [(*others[i], *others[j]) for i in range(len(others))
              for j in range(i + 1, len(others))]
    pairs += [(*algebra[i + 1], *algebra[i]) for i in range(len(algebra) - 1)]
    return pairs


_NO_DAMAGE = 1e-6
"""Log-perplexity change below which a change did no damage (perplexity within 0.0001%)."""


def _recovered(original: float, changed: float, healed: float) -> float | None:
    """Share of the log-perplexity damage that healing undid (``None`` without damage:
    an unchanged model evaluated twice differs in the last bits, and a share of that
    rounding noise is no number)."""
    damage = math.log(changed) - math.log(original)
    if damage <= _NO_DAMAGE:
        return None
    return (math.log(changed) - math.log(healed)) / damage


def _arm_of(runs: list[dict[str, Any]], name: str, text: str) -> Arm | str:
    """The healed runs of one arm on ``text`` as a :class:`~structlm.stats.Arm`, or why
    there is none."""
    if not all(WindowScores.has_scores((r.get("eval_healed") or {}).get(text)) for r in runs):
        return "runs without per-window scores (recorded before they were kept)"
    return Arm(name, tuple(WindowScores.from_dict(r["eval_healed"][text]) for r in runs),
               budget=runs[0].get("train_budget") or {})


def verdict(runs_a: list[dict[str, Any]], runs_b: list[dict[str, Any]], name_a: str,
            name_b: str, text: str) -> str:
    """The verdict between two arms' healed runs on ``text`` (:func:`structlm.stats.compare`
    paired by window), with the mean perplexity ratio."""
    ppl_a = statistics.fmean(r["ppl_healed"][text] for r in runs_a)
    ppl_b = statistics.fmean(r["ppl_healed"][text] for r in runs_b)
    head = f"{name_a} {ppl_a / ppl_b - 1:+.1%} vs {name_b}"
    a, b = _arm_of(runs_a, name_a, text), _arm_of(runs_b, name_b, text)
    if not isinstance(a, Arm) or not isinstance(b, Arm):
        return f"{head}: no verdict ({a if isinstance(b, Arm) else b})"
    try:
        c = compare(a, b)
    except UnequalBudgetError:
        return (f"{head}: no verdict (unequal budgets: {dict(a.budget)} vs "
                f"{dict(b.budget)})")
    if c.decided:
        return f"{head}: **{c.lower} better** ({c.interval_text()})"
    return f"{head}: {c.verdict} ({c.interval_text()})"


def _seeds_text(cfg: Any) -> str:
    """Which arms are healed with which seeds."""
    targets = getattr(cfg, "seed_targets", None)
    if targets is None or len(cfg.seeds) == 1:
        return f"{cfg.seeds}"
    return (f"{cfg.seeds} for the algebra and baseline arms on {', '.join(targets)}, "
            f"{cfg.seeds[:1]} for every other arm and the dense controls")


def _fmt(x: float | None, nd: int = 2) -> str:
    return "—" if x is None else f"{x:,.{nd}f}"


def write_convert_report(res: dict[str, Any], cfg: Any, out: Path,
                         plots: bool = True) -> None:
    """Write ``report.md``, and the plot when ``plots``, from the results so far (partial
    runs too)."""
    texts = res["eval_texts"]
    orig = res["original"]
    lines = [f"# structlm experiment convert: {res['model']}", ""]
    if res.get("model_note"):
        lines += [res["model_note"], ""]
    after = ("constant" if cfg.heal.min_lr_ratio == 1
             else f"cosine to {cfg.heal.min_lr_ratio}× the peak")
    lines += [f"Schedule `{cfg.schedule}`; healing: {cfg.heal.steps} steps × "
              f"{cfg.heal.batch_size} × {cfg.heal.seq_len} tokens of `{cfg.corpus}` "
              f"calibration text, lr {cfg.heal.lr} ({cfg.heal.lr_scaling}; {cfg.heal.warmup} "
              f"warm-up steps, then {after}), the changed "
              f"modules' parameters trained (the same modules for the dense control; the "
              f"svd arms train their factors, with any biases frozen as in the share "
              f"fine-tuning); seeds {_seeds_text(cfg)}. Baselines are checked against the "
              f"algebra's projection MACs (within {cfg.mac_tolerance:.0%} below) before "
              f"healing.", ""]
    distill = getattr(cfg, "distill", None)
    if distill is not None and distill.steps:
        lines += [f"The `+distill` variants are first trained {distill.steps} steps × "
                  f"{distill.batch_size} × {distill.seq_len} tokens to reproduce the dense "
                  f"modules' outputs (mean relative squared error per converted module, "
                  f"lr {distill.lr}, {distill.lr_scaling}, cosine to {distill.min_lr_ratio}"
                  f"× after {distill.warmup} warm-up steps), then healed like every arm: "
                  f"these steps come on top of the common healing budget.", ""]
    for name in texts:
        d = res["text"].get(name, {})
        lines.append(f"- `{name}`: {d.get('tokens', '?')} scored tokens in "
                     f"{d.get('windows', '?')} windows of {d.get('window', '?')} drawn across "
                     f"{len(d.get('windows_per_document', {}) or [])} held-out documents.")
    lines += ["", "Perplexities are means over the seeds (the healed one with the seeds' "
              "[min–max] where an arm has several); recovered = share of the "
              "log-perplexity damage of the change that healing undid.", "", RULE, "",
              f"Original: projection MACs / token {orig['projection_macs']:,.0f}; "
              + ", ".join(f"{t} ppl {orig['ppl'][t]:.2f}" for t in texts), ""]
    groups = _group(res.get("arms", []))
    for target in cfg.targets:
        rows = [(k, v) for k, v in groups.items() if k[0] == target]
        if not rows:
            continue
        lines += [f"## {target}", "",
                  "| arm | seeds | MACs / token (× original) | projection params | trained "
                  "params | " + " | ".join(f"{t}: changed → distilled → healed (recovered)"
                                           for t in texts)
                  + " |", "|---|---:|---:|---:|---:|" + "---:|" * len(texts)]
        for (_, arm, _), runs in rows:
            r0 = runs[0]
            cells = []
            for t in texts:
                ch = statistics.fmean(r["ppl_changed"][t] for r in runs)
                di = (statistics.fmean(r["ppl_distilled"][t] for r in runs)
                      if all("ppl_distilled" in r for r in runs) else None)
                healed = [r["ppl_healed"][t] for r in runs]
                he = statistics.fmean(healed)
                rec = _recovered(orig["ppl"][t], ch, he)
                span = (f" [{_fmt(min(healed))}–{_fmt(max(healed))}]" if len(runs) > 1
                        else "")
                cells.append(f"{_fmt(ch)} → {_fmt(di)} → {_fmt(he)}{span} "
                             f"({'—' if rec is None else f'{rec:.0%}'})")
            lines.append(f"| {arm} | {len(runs)} | {r0['projection_macs']:,.0f} "
                         f"({r0['projection_macs'] / orig['projection_macs']:.3f}) | "
                         f"{r0['projection_parameters']:,} | {r0['trained_parameters']:,} | "
                         + " | ".join(cells) + " |")
        lines += ["", "Which is better at each budget (healed perplexity):", ""]
        for alg in cfg.algebras:
            for t in texts:
                for name_a, runs_a, name_b, runs_b in _pairs(groups, target, alg):
                    lines.append(f"- {alg} budget, `{t}`: "
                                 + verdict(runs_a, runs_b, name_a, name_b, t))
        lines.append("")
    lines += ["![perplexity vs MACs](ppl_vs_macs.png)", ""]
    lines += _curve_lines(res.get("arms", []), getattr(cfg, "plateau_steps", 50),
                          getattr(cfg, "plateau_change", 0.02))
    lines += breakdown_lines(res.get("arms", []))
    atomic_write_text(out / "report.md", "\n".join(lines))
    if plots:
        plot_breakdown(res.get("arms", []), out / "module_errors.png")
        _plot(res, texts, out / "ppl_vs_macs.png")
        _plot_curves(res.get("arms", []), cfg.targets, out / "healing_curves.png")


def _evals(run: dict[str, Any]) -> list[tuple[int, float]]:
    """``(step, validation perplexity)`` at every evaluation of a healing run."""
    return [(c["step"], c["val_ppl"]) for c in run["curve"] if c.get("val_ppl") is not None]


def plateau(run: dict[str, Any], steps: int, change: float
            ) -> tuple[int, float, int, float, float, bool] | None:
    """The plateau check of one healing curve: ``(s0, ppl0, s1, ppl1, lr ratio, flat)``
    with ``s1`` the last evaluation, ``s0`` the last one at least ``steps`` before it,
    the lowest learning rate between them as a fraction of the peak, and ``flat`` when
    the perplexity changed by less than ``change`` there at a rate that had not decayed
    (>= 0.99 of the peak). ``None`` when the curve is too short."""
    pts = _evals(run)
    if len(pts) < 2:
        return None
    s1, p1 = pts[-1]
    earlier = [(s, p) for s, p in pts if s <= s1 - steps]
    if not earlier:
        return None
    s0, p0 = earlier[-1]
    peak = run["heal"]["lr"]
    lrs = [c["lr"] for c in run["curve"] if s0 < c["step"] <= s1 and c.get("lr") is not None]
    lr = min(lrs) / peak if lrs and peak else 1.0
    return s0, p0, s1, p1, lr, abs(p1 / p0 - 1) < change and lr >= 0.99


def _curve_lines(arms: list[dict[str, Any]], steps: int, change: float) -> list[str]:
    """Has healing plateaued? :func:`plateau` for every arm and seed."""
    rows = []
    for (target, arm, _), runs in _group(arms).items():
        for r in runs:
            p = plateau(r, steps, change)
            if p is None:
                continue
            s0, p0, s1, p1, lr, flat = p
            rows.append(f"| {target} | {arm} | {r['seed']} | {s0}: {p0:,.2f} | {s1}: {p1:,.2f}"
                        f" | {p1 / p0 - 1:+.1%} | {lr:.2f} | {'yes' if flat else '**no**'} |")
    if not rows:
        return []
    return ["## Healing curves", "",
            f"Validation perplexity (the held-out tails of the calibration documents, not "
            f"the test windows of the table) at the last evaluation "
            f"and {steps} steps before it; flat = changed by less than {change:.0%} there "
            f"at a learning rate that had not decayed (lowest rate in that stretch / "
            f"peak >= 0.99).", "",
            "| target | arm | seed | step: ppl | step: ppl | change | lr / peak | flat |",
            "|---|---|---:|---:|---:|---:|---:|---|", *rows, "",
            "![healing curves](healing_curves.png)", ""]


def _plot_curves(arms: list[dict[str, Any]], targets: list[str], path: Path) -> None:
    """In-domain perplexity against healing step, one panel per target, one line per
    arm and seed (log scale)."""
    from structlm.plotting import pyplot

    plt = pyplot()

    groups = [(k, v) for k, v in _group(arms).items() if any(len(_evals(r)) for r in v)]
    shown = [t for t in targets if any(k[0] == t for k, _ in groups)]
    if not shown:
        return
    colors: dict[str, str] = {}  # one colour per arm name in every panel
    for (_, arm, _), _runs in groups:
        colors.setdefault(arm, f"C{len(colors) % 10}")
    fig, axes = plt.subplots(1, len(shown), figsize=(6 * len(shown), 4.5), squeeze=False)
    for ax, target in zip(axes[0], shown, strict=True):
        for (t, arm, _), runs in groups:
            if t != target:
                continue
            for i, r in enumerate(runs):
                steps, ppl = zip(*_evals(r), strict=True)
                ax.plot(steps, ppl, marker="o", ms=3, lw=1, color=colors[arm],
                        label=arm if i == 0 else None)
        ax.set_yscale("log")
        ax.set_xlabel("healing step")
        ax.set_ylabel("in-domain perplexity (healing's eval windows)")
        ax.set_title(f"healing: {target}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    save_figure(fig, path)



def _plot(res: dict[str, Any], texts: list[str], path: Path) -> None:
    from structlm.plotting import pyplot

    plt = pyplot()

    arms = res.get("arms", [])
    if not arms:
        return
    orig = res["original"]
    fig, axes = plt.subplots(1, len(texts), figsize=(6 * len(texts), 4.5), squeeze=False)
    markers = {"algebra": "o", "prune": "s", "svd": "^", "dense": "D"}
    for ax, t in zip(axes[0], texts, strict=True):
        ax.axhline(orig["ppl"][t], color="grey", lw=0.8, ls=":", label="original")
        for (target, arm, _), runs in _group(arms).items():
            x = runs[0]["projection_macs"] / orig["projection_macs"]
            ch = statistics.fmean(r["ppl_changed"][t] for r in runs)
            he = statistics.fmean(r["ppl_healed"][t] for r in runs)
            m = markers.get(runs[0]["kind"], "x")
            line = ax.plot([x], [he], m, label=f"{arm} ({target})")[0]
            ax.plot([x, x], [ch, he], color=line.get_color(), lw=0.8, alpha=0.6)
            ax.plot([x], [ch], m, mfc="none", color=line.get_color())
            if all("ppl_distilled" in r for r in runs):
                di = statistics.fmean(r["ppl_distilled"][t] for r in runs)
                ax.plot([x], [di], "x", color=line.get_color())
        ax.set_yscale("log")
        ax.set_xlabel("projection MACs / token (× original)")
        ax.set_ylabel("perplexity (hollow: changed, x: distilled, filled: healed)")
        ax.set_title(t)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    save_figure(fig, path)
