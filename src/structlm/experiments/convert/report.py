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

__all__ = ["plateau", "verdict", "write_convert_report"]

RULE = ("Verdict rule (set before the runs): at one MAC budget and on one text, arm A is "
        "better than arm B when A's healed perplexities over the seeds all lie below B's "
        "(ranges [min, max] do not overlap); with one seed per arm the difference is "
        "reported without a verdict.")


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


def verdict(a: list[float], b: list[float], name_a: str, name_b: str) -> str:
    """The pre-set rule on healed perplexities ``a`` and ``b`` (one per seed)."""
    diff = statistics.fmean(a) / statistics.fmean(b) - 1
    text = f"{name_a} {diff:+.1%} vs {name_b}"
    if len(a) < 2 or len(b) < 2:
        return text + " (one seed: no verdict)"
    if max(a) < min(b):
        return text + f": **{name_a} better**"
    if max(b) < min(a):
        return text + f": **{name_b} better**"
    return text + ": ranges overlap (no difference shown)"


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
                    lines.append(f"- {alg} budget, `{t}`: " + verdict(
                        [r["ppl_healed"][t] for r in runs_a],
                        [r["ppl_healed"][t] for r in runs_b], name_a, name_b))
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
    """``(step, in-domain perplexity)`` at every evaluation of a healing run."""
    return [(c["step"], c["eval_ppl"]) for c in run["curve"] if c.get("eval_ppl") is not None]


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
            f"In-domain perplexity on the healing run's own evaluation windows (fewer "
            f"tokens than the table's, so not comparable with it) at the last evaluation "
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
