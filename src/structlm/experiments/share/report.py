"""Report of ``structlm experiment share``: per text, every arm's numbers and the
verdicts of the rules fixed in advance; plots of perplexity against the budget, of
energy against perplexity, and of the fine-tuning curves.

Rules (applied per text whatever they say; every verdict through ``structlm.stats``):

* **winner at a budget** (after fine-tuning): the methods' runs (fine-tuning seeds, and
  calibration draws as strata) are compared pairwise, paired by test window, with a 95%
  hierarchical-bootstrap interval of the difference in mean NLL; a method wins only if its
  interval against every other method lies below zero, otherwise "no winner shown" (every
  pair's interval is printed). Arms trained under different budgets are not compared;
* **before fine-tuning**: the analytic models (no seed) compared the same way over the
  windows (first calibration draw);
* **equal compute**: every pair of fine-tuned entries of different methods whose MACs per
  token agree within 1%, compared the same way;
* **test 5** (fine-tuning repairs): lives if the Student-t interval over runs of the share
  of the log-perplexity damage undone, ``(log p_analytic − log p_tuned) / (log p_analytic −
  log p_orig)``, lies above 50% (fails if below, otherwise undecided);
* **tests 7/9**: a compressed model is usable within 2× the original perplexity (one
  seed: its value, no verdict);
* **plateau** (read on the *validation* curve, never the test windows): a run has
  plateaued if the mean validation perplexity of its last ``plateau_window`` evaluations
  differs from the mean of the ``plateau_window`` before by less than 2%. With
  ``continue_unplateaued_to``, when any whole-model run has not plateaued, every
  whole-model run is continued (equal budgets). With ``finetune.keep_best`` each run's
  model is its best validation checkpoint. Beside it (a flag, no arm is excluded by it):
  the runs whose last evaluation ends more than 2% above their own best.

Budgets are stored parameters (the papers' convention); the MACs / token column gives
the decoder projections' multiply-adds per token over the original's, at one row in the
modules' own order: a shared basis is applied in every layer, so equal storage is not
equal compute (the two-sided ``shared`` costs more than the dense model at mild budgets).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from structlm.atomic import atomic_write_text
from structlm.experiments.share.beside import beside_finetune_text, beside_label, beside_stats
from structlm.experiments.share.verdicts import (
    PAIR_HEADER,
    analytic_arm,
    equal_compute_pairs,
    pair_rows,
    ranking_text,
    recovery_verdict,
    tuned_arm,
)
from structlm.share.compress import get_method

__all__ = ["plateau_rows", "recovered", "run_plateaued", "write_experiment_report"]

PLATEAU_CHANGE = 0.02
"""The plateau rule: a last evaluation interval changing perplexity by less than this."""


def _f(x: float | None, nd: int = 2) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{nd}f}"


def _pct(x: float) -> str:
    """A share as a percentage; "—" before the fine-tuning that gives it has run."""
    return "—" if not math.isfinite(x) else f"{100 * x:.0f}%"


def _ft(s: dict[str, float]) -> str:
    if not s:
        return "—"
    rng = f" [{s['min']:.2f}–{s['max']:.2f}]" if s["n"] > 1 else ""
    return f"{s['mean']:.2f} ± {s['std']:.2f}{rng} (n={s['n']})"


def recovered(orig: float, analytic: float, tuned: float) -> float:
    """Share of the compression's log-perplexity damage undone by fine-tuning (NaN when
    compression did no damage)."""
    gap = math.log(analytic) - math.log(orig)
    return (math.log(analytic) - math.log(tuned)) / gap if gap > 1e-9 else float("nan")


def _whole_table(res: dict[str, Any], text: str) -> list[str]:
    orig = res["ppl_original"][text]
    texts = res["eval_texts"]
    bes = res.get("beside")
    extra = f" {beside_label(bes)} |" if bes else ""
    lines = [f"| reduction | method | stored / original | MACs / token | energy kept | "
             f"analytic ppl | fine-tuned ppl |{extra} recovered here | recovered on "
             f"{_other(texts, text)} |", "|---|---|---|---|---|---|---|---|---|"
             + ("---|" if bes else ""),
             f"| 0% | original | 1 | 1 | 1 | {_f(orig)} | — |{' — |' if bes else ''} — | — |"]
    for e in res["whole_model"]:
        a0 = e["arms"][0]
        energy = sum(a0["energy_kept"].values()) / len(a0["energy_kept"])
        ft = e["finetuned"].get(text, {})
        other = _other(texts, text)
        rec = _rec(res, e, text)
        rec_o = _rec(res, e, other) if other else float("nan")
        old = (f" {_ft(beside_stats(bes, e['method'], e['reduction'], text))} |"
               if bes else "")
        lines.append(f"| {e['reduction']:.0%} | {e['method']} | "
                     f"{a0['stored_parameters'] / a0['original_parameters']:.4f} | "
                     f"{_macs(a0)} | {energy:.3f} | {_analytic(e, text)} | {_ft(ft)} |{old} "
                     f"{_pct(rec)} | {_pct(rec_o)} |")
    return lines


def _analytic(e: dict[str, Any], text: str) -> str:
    """The analytic perplexity (the first calibration draw), with the range over draws
    when there are several."""
    by = [v[text] for v in (e.get("analytic_by_draw") or {}).values()]
    if len(by) < 2:
        return _f(e["analytic"][text])
    return f"{_f(e['analytic'][text])} [{_f(min(by))}–{_f(max(by))} over {len(by)} draws]"


def _macs(arm: dict[str, Any]) -> str:
    """Decoder projection MACs per token over the original's (one-row order)."""
    r = arm.get("token_macs_ratio")
    return "—" if r is None else f"{r:.3f}"


def _other(texts: list[str], text: str) -> str:
    rest = [t for t in texts if t != text]
    return rest[0] if rest else ""


def _rec(res: dict[str, Any], e: dict[str, Any], text: str) -> float:
    ft = e["finetuned"].get(text)
    if not ft:
        return float("nan")
    return recovered(res["ppl_original"][text], e["analytic"][text], ft["mean"])


def _verdicts(entries: list[dict[str, Any]], text: str) -> list[str]:
    """Per budget: the verdict before fine-tuning (analytic models, paired over windows)
    and after (the runs, paired by window), then every pair's interval."""
    rows = ["| budget | before fine-tuning | after fine-tuning |", "|---|---|---|"]
    pairs = []
    for red in sorted({e["reduction"] for e in entries}):
        at = [e for e in entries if e["reduction"] == red]
        names = [e["method"] for e in at]
        before, _ = ranking_text([analytic_arm(e, text) for e in at], names)
        after, ranking = ranking_text([tuned_arm(e, text) for e in at], names)
        rows.append(f"| −{red:.0%} | {before} | {after} |")
        if ranking is not None:
            pairs += list(ranking.pairs)
    if pairs:
        rows += ["", "Every pair after fine-tuning (Δ = first − second; a verdict only where "
                 "the interval excludes zero):", "", *PAIR_HEADER, *pair_rows(pairs)]
    return rows


def _equal_compute(entries: list[dict[str, Any]], text: str) -> list[str]:
    """The equal-compute pairs (MACs per token within 1%), fine-tuned."""
    found = equal_compute_pairs(entries, text)
    if not found:
        return []
    lines = ["**Equal compute** (MACs per token within 1%; fine-tuned):", ""]
    done = [c for _, _, c in found if not isinstance(c, str)]
    for x, y, c in found:
        if isinstance(c, str):
            lines.append(f"- −{x['reduction']:.0%} {x['method']} vs −{y['reduction']:.0%} "
                         f"{y['method']}: {c}")
    if done:
        lines += ["", *PAIR_HEADER, *pair_rows(done)]
    return [*lines, ""]


def _seed_section(res: dict[str, Any], text: str, key: str = "seed_regime") -> list[str]:
    """The seed regime (``seed_regime``: the stronger control, relative rates) or the
    seed's own test-6 control (``seed_control``: plain AdamW at an absolute rate)."""
    sr = res.get(key)
    if not sr:
        return []
    orig = res["ppl_original"][text]
    title = ("The seed's regime" if key == "seed_regime" else
             "Test 6 as the seed states it: per-layer free factors from a random and a "
             "plain-SVD start, every arm trained with plain AdamW at an absolute rate")
    lines = [f"### {title}: {sr['types']} only, shared at k = {sr['k']} "
             f"(removes {sr['reduction_of_shared']:.1%} of it); the others at the storage "
             "that leaves (the closest each can reach without exceeding it)", "",
             "| method | stored / original | MACs / token | energy kept | analytic ppl | "
             "fine-tuned ppl | recovered | test 5 |", "|---|---|---|---|---|---|---|---|"]
    for e in sr["entries"]:
        a0 = e["arms"][0]
        ft = e["finetuned"].get(text, {})
        rec = _rec(res, e, text)
        energy = sum(a0["energy_kept"].values()) / len(a0["energy_kept"])
        lines.append(f"| {e['method']} | {a0['stored_parameters'] / a0['original_parameters']:.4f}"
                     f" | {_macs(a0)} | {energy:.3f} | "
                     f"{_f(e['analytic'][text])} | {_ft(ft)} | {_pct(rec)} | "
                     f"{recovery_verdict(e, orig, text)} |")
    test6, ranking = ranking_text([tuned_arm(e, text) for e in sr["entries"]],
                                  [e["method"] for e in sr["entries"]])
    lines += ["", f"Original {_f(orig)}. Test 6 (same budget, fine-tuned): {test6}.", ""]
    if ranking is not None:
        lines += [*PAIR_HEADER, *pair_rows(list(ranking.pairs)), ""]
    return lines


def _scope_rows(res: dict[str, Any], text: str) -> list[str]:
    orig = res["ppl_original"][text]
    rows = []
    for arm in res["scope"]:
        tuned = arm.get("ppl_finetuned", {}).get(text)
        extra = ""
        if arm["residual_share_of_basis_error"]:
            cover = sum(arm["residual_share_of_basis_error"].values()) / len(
                arm["residual_share_of_basis_error"])
            extra = f"; residual covers {cover:.0%} of the basis error"
        test = 9 if get_method(arm["method"]).has_residual else 7
        usable = ("not fine-tuned yet" if tuned is None else
                  "usable (≤ 2× original)" if tuned <= 2 * orig else "not usable")
        rows.append(f"| {test} | {arm['method']} on {arm['types']} | {arm['ratio']:.2f}× | "
                    f"{_macs(arm)} | "
                    f"{_f(arm['ppl_analytic'][text])} | {_f(tuned)}{extra} | {usable} |")
    return rows


def _evals(arm: dict[str, Any]) -> list[tuple[int, float]]:
    """``(step, validation perplexity)`` at every evaluation of a fine-tuning run (none
    for a curve recorded on test windows before validation text existed: it decides
    nothing)."""
    return [(c["step"], c["val_ppl"]) for c in arm.get("curve") or []
            if c.get("val_ppl") is not None]


def run_plateaued(arm: dict[str, Any], window: int = 1) -> bool | None:
    """The plateau rule on one run: the mean validation perplexity of its last ``window``
    evaluations against the ``window`` before changed by less than PLATEAU_CHANGE
    (``None``: fewer than ``2 window`` evaluations on the validation text)."""
    pts = _evals(arm)
    if len(pts) < 2 * window:
        return None
    a = statistics.fmean(v for _, v in pts[-2 * window:-window])
    b = statistics.fmean(v for _, v in pts[-window:])
    return abs(b / a - 1) < PLATEAU_CHANGE


def plateau_rows(res: dict[str, Any], window: int = 1) -> list[str]:
    """Had fine-tuning plateaued? Per fine-tuned setting: the subset perplexity over the
    last ``window`` evaluations and the ``window`` before (each a mean over them, then
    over the seeds done), the change, the plateau rule."""
    groups = [("seed regime", e) for e in (res.get("seed_regime") or {}).get("entries", [])]
    groups += [("seed control", e) for e in (res.get("seed_control") or {}).get("entries", [])]
    groups += [("whole model", e) for e in res["whole_model"]]
    rows = []
    for regime, e in groups:
        pts = [_evals(a) for a in e["arms"] if "ppl_finetuned" in a]
        if not pts or any(len(p) < 2 * window for p in pts):
            continue
        a = statistics.fmean(statistics.fmean(v for _, v in p[-2 * window:-window])
                             for p in pts)
        b = statistics.fmean(statistics.fmean(v for _, v in p[-window:]) for p in pts)
        where = regime if regime.startswith("seed") else f"{regime} −{e['reduction']:.0%}"
        rule = "plateaued" if abs(b / a - 1) < PLATEAU_CHANGE else "still moving"
        steps = _steps(pts[0], window) + (" (runs of other lengths: each its own last "
                                          "evaluations)" if len({p[-1][0] for p in pts}) > 1
                                          else "")
        rows.append(f"| {where} | {e['method']} | {len(pts)} | {steps} | "
                    f"{a:,.2f} | {b:,.2f} | {b / a - 1:+.1%} | "
                    f"{_lr_share(e, window)} | {rule} | {_above_best(pts)} |")
    return rows


def _steps(p: list[tuple[int, float]], window: int) -> str:
    """The evaluation steps the rule compares, e.g. ``450 → 500`` or ``350–450 → 500–600``."""
    if window == 1:
        return f"{p[-2][0]} → {p[-1][0]}"
    return (f"{p[-2 * window][0]}–{p[-window - 1][0]} → {p[-window][0]}–{p[-1][0]}")


def _lr_share(e: dict[str, Any], window: int = 1) -> str:
    """The lowest learning rate over the evaluations the rule compares, over the peak
    (first fine-tuned arm): a plateau at a decayed rate may only mean the rate stopped it."""
    arm = next((a for a in e["arms"] if a.get("curve")), None)
    if arm is None:
        return "—"
    ev = [c["step"] for c in arm["curve"] if c.get("val_ppl") is not None]
    lrs = [c["lr"] for c in arm["curve"] if c.get("lr") is not None
           and len(ev) >= 2 * window and ev[-2 * window] < c["step"] <= ev[-1]]
    peak = max((c["lr"] for c in arm["curve"] if c.get("lr") is not None), default=0.0)
    return f"{min(lrs) / peak:.2f}" if lrs and peak else "—"


def _above_best(pts: list[list[tuple[int, float]]]) -> str:
    """Seeds whose last evaluation ends above their best by more than the plateau
    change, with the largest excess ("—" when none)."""
    excess = [p[-1][1] / min(v for _, v in p) - 1 for p in pts]
    worse = [x for x in excess if x > PLATEAU_CHANGE]
    return f"{len(worse)} of {len(pts)} (up to +{max(worse):.0%})" if worse else "—"


def _plateau_lines(res: dict[str, Any], text: str, window: int = 1) -> list[str]:
    rows = plateau_rows(res, window)
    if not rows:
        return []
    compared = ("the last two evaluations" if window == 1 else
                f"the mean of the last {window} evaluations against the mean of the "
                f"{window} before")
    return ["## Had fine-tuning plateaued?", "",
            f"Perplexity on the validation windows (the held-out tails of the {text} "
            f"calibration documents; not the test windows of the tables): {compared}, "
            f"mean over seeds; the rule: a change under {PLATEAU_CHANGE:.0%} is a plateau. "
            f"*Ended above best*: seeds whose last evaluation is more than "
            f"{PLATEAU_CHANGE:.0%} above their own best (training made them worse: unstable).",
            "*lr*: the lowest learning rate over the compared evaluations, over the run's "
            "peak (a plateau at a decayed rate may only mean the rate stopped training).",
            "", "| setting | method | seeds | steps | before | last | change | lr | rule | "
            "ended above best |", "|---|---|---:|---|---:|---:|---:|---:|---|---|", *rows, ""]


def _plots(res: dict[str, Any], out: Path) -> None:
    from structlm.plotting import pyplot

    plt = pyplot()

    texts = res["eval_texts"]
    fig, axes = plt.subplots(1, len(texts), figsize=(6 * len(texts), 4.5), squeeze=False)
    methods = list(dict.fromkeys(e["method"] for e in res["whole_model"]))
    for ax, text in zip(axes[0], texts, strict=True):
        for i, m in enumerate(methods):
            es = sorted((e for e in res["whole_model"] if e["method"] == m),
                        key=lambda e: e["reduction"])
            x = [100 * e["reduction"] for e in es]
            color = f"C{i}"
            ax.plot(x, [e["analytic"][text] for e in es], "--", color=color, lw=0.8,
                    marker="x", label=f"{m} analytic")
            tuned = [(100 * e["reduction"], e["finetuned"][text]) for e in es
                     if e["finetuned"].get(text)]
            if tuned:
                ax.errorbar([t[0] for t in tuned], [t[1]["mean"] for t in tuned],
                            yerr=[[t[1]["mean"] - t[1]["min"] for t in tuned],
                                  [t[1]["max"] - t[1]["mean"] for t in tuned]],
                            color=color, marker="o", ms=3, capsize=3, label=f"{m} fine-tuned")
        ax.axhline(res["ppl_original"][text], color="k", lw=0.8, ls=":", label="original")
        ax.set_yscale("log")
        ax.set_xlabel("% of every decoder linear type's parameters removed")
        ax.set_ylabel("perplexity")
        ax.set_title(text)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "ppl_vs_budget.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    text = texts[0]
    for e in res["whole_model"]:
        a = e["arms"][0]
        en = sum(a["energy_kept"].values()) / len(a["energy_kept"])
        ax.scatter(en, a["ppl_analytic"][text], color=f"C{methods.index(e['method'])}",
                   label=e["method"] if e["reduction"] == res["whole_model"][0]["reduction"]
                   else None)
    ax.axhline(res["ppl_original"][text], color="k", lw=0.8, ls="--", label="original")
    ax.set_yscale("log")
    ax.set_xlabel("functional energy kept (mean over types)")
    ax.set_ylabel(f"perplexity before fine-tuning ({text})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "energy_vs_ppl.png", dpi=110)
    plt.close(fig)

    groups = [(title, entries) for title, entries in (
        ("whole model", res["whole_model"]),
        ("seed regime", (res.get("seed_regime") or {}).get("entries")),
        ("seed control", (res.get("seed_control") or {}).get("entries"))) if entries]
    if not groups:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.5), squeeze=False)
    for ax, (title, entries) in zip(axes[0], groups, strict=True):
        for j, e in enumerate(entries):
            for arm in e["arms"]:
                ev = _evals(arm)
                lbl = (f"{e['method']} −{e['reduction']:.0%}" if e["reduction"] is not None
                       else e["method"]) if arm is e["arms"][0] else None
                ax.plot([st for st, _ in ev], [p for _, p in ev], "o-", ms=2,
                        lw=0.7, color=f"C{j % 10}", label=lbl)
        ax.set_yscale("log")
        ax.set_xlabel("fine-tuning step")
        ax.set_ylabel("validation perplexity")
        ax.set_title(f"{title}: every seed")
        ax.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "finetune_curves.png", dpi=110)
    plt.close(fig)


def _text_lines(res: dict[str, Any]) -> list[str]:
    lines = ["## Text", ""]
    for name, d in res["text"].items():
        docs = ", ".join(f"{k} ({v})" for k, v in d["windows_per_document"].items())
        lines.append(f"- **{name}**: {d['windows']} windows × {d['window']} tokens "
                     f"({d['tokens']:,} tokens; seed {d['seed']}) drawn across documents — "
                     f"{docs}.")
    return [*lines, "- Evaluation scores every window's tokens after its first "
            "(`structlm.hf.perplexity`); fine-tuning draws random windows from the whole "
            "calibration documents.", ""]


def _continued_text(continued: list[dict[str, Any]]) -> str:
    """The runs taken past their step count (``continue_unplateaued_to``), or ""."""
    if not continued:
        return ""
    runs = ", ".join(f"`{c['method']}` −{c['reduction']:.0%} seed {c['seed']}"
                     + (f" (draw {c['calib_seed']})" if c.get("calib_seed") else "")
                     for c in continued)
    return (f" Continued from {continued[0]['from_steps']} to {continued[0]['to_steps']} "
            f"steps, not having plateaued by the rule on the run alone (their numbers, "
            f"curves and plateau rows below are the continued runs'): {runs}.")


def _probe_lines(probes: dict[str, Any]) -> list[str]:
    """The learning-rate probes: each method's best validation perplexity per rate and the
    rate chosen (on the validation text only)."""
    lines = []
    for section, probe in probes.items():
        rates = probe["rates"]
        lines += [f"## Learning-rate probe: {section} ({probe['setting']}, seed "
                  f"{probe['seed']}, {probe['steps']} steps, {probe['lr_scaling']} rates, best "
                  "validation checkpoint)", "",
                  "Each method's rate is the one whose best *validation* perplexity is lowest "
                  "(the test windows are not scored in the probe).", "",
                  "| method | " + " | ".join(f"lr {r:g}" for r in rates) + " | chosen |",
                  "|---|" + "---:|" * len(rates) + "---|"]
        for m, d in probe["methods"].items():
            if "rate" not in d:
                lines.append(f"| {m} | " + " | ".join("—" for _ in rates)
                             + f" | {d['done']} of {d['planned']} runs done |")
                continue
            cells = [f"{math.exp(d['best_val_nll'][str(r)]):.2f} (step "
                     f"{d['best_step'][str(r)]})" for r in rates]
            edge = " (at the grid's edge)" if d["at_edge"] else ""
            lines.append(f"| {m} | {' | '.join(cells)} | {d['rate']:g}{edge} |")
        lines.append("")
    return lines


def write_experiment_report(res: dict[str, Any], cfg: Any, out: Path,
                            plots: bool = True) -> None:
    """``report.md``, and the plots when ``plots``."""
    if plots:
        _plots(res, out)
    ft, sft = cfg.finetune, cfg.seed_finetune

    def ft_text(f: Any) -> str:
        return (f"{f.steps} steps × {f.batch_size} × {f.seq_len} tokens, lr {f.lr} "
                f"({f.lr_scaling}), warm-up {f.warmup}, cosine to {f.min_lr_ratio}×")

    lines = [f"# Shared functional bases — tests 4–9 on {res['model']}", ""]
    if res.get("model_note"):
        lines += [f"**Note:** {res['model_note']}.", ""]
    runs = res.get("finetuned_runs", {})
    if runs and runs["done"] < runs["planned"]:
        lines += [f"**Partial:** {runs['done']} of {runs['planned']} fine-tuning runs done "
                  "so far (every arm's analytic numbers are complete); a rerun of the same "
                  "command resumes from arms.json.", ""]
    lines += [f"Whole-model regime: {cfg.reductions} of every decoder linear type's "
              f"parameters ({cfg.types}) removed by each method, stored parameters equal to "
              f"the budget within {cfg.budget_tolerance:.1%} (asserted). Every whole-model "
              f"and scope arm is fine-tuned the same way: {ft_text(ft)}; the seed regime's "
              f"arms: {ft_text(sft)}. Seeds {cfg.seeds} at {cfg.multi_seed_reductions} and "
              f"in the seed regime, seed {cfg.seeds[0]} elsewhere. `basis-sharing`: groups of "
              f"{cfg.group_size} consecutive layers, update step "
              f"{'on' if cfg.update else 'off'}."
              + (f" Calibration draws {cfg.calib_seeds} (the whole-model regime runs at "
                 "each, draw k with the fine-tuning seeds shifted by k × (max seed + 1); its "
                 "fine-tuned ranges span seeds × draws)."
                 if len(getattr(cfg, "calib_seeds", [0])) > 1 else "")
              + _continued_text(res.get("continued") or [])
              + (f" Fine-tuned methods: {cfg.finetune_methods} (the others analytic only)."
                 if getattr(cfg, "finetune_methods", None) is not None else "")
              + (f" Per-method learning rates of the whole-model fine-tuning: "
                 f"{cfg.finetune_lr} (the other methods at lr {ft.lr})."
                 if getattr(cfg, "finetune_lr", None) else ""), "",
              "Rules" + (__doc__ or "Rules").split("Rules", 1)[1].rstrip(), ""]
    if res.get("beside"):
        lines += [f"Beside this run: the same arms of `{res['beside']['folder']}` (the same "
                  f"model and evaluation text, checked), fine-tuned "
                  f"{beside_finetune_text(res['beside'])}: numbers only (they take part in "
                  "no verdict).", ""]
    lines += _probe_lines(res.get("lr_probe") or {})
    lines += _text_lines(res)
    for text in res["eval_texts"]:
        lines += [f"## {text}", "", *_seed_section(res, text),
                  *_seed_section(res, text, "seed_control"),
                  "### Whole-model compression", "", *_whole_table(res, text), "",
                  *_verdicts(res["whole_model"], text), "",
                  *_equal_compute(res["whole_model"], text)]
        if res["scope"]:
            lines += ["### Tests 7 and 9: where sharing works (one seed, equal per-type "
                      "reduction)", "", "| test | arm | ratio | MACs / token | analytic | "
                      "fine-tuned | verdict |", "|---|---|---|---|---|---|---|",
                      *_scope_rows(res, text), ""]
    lines += _plateau_lines(res, res["eval_texts"][0], getattr(cfg, "plateau_window", 1))
    lines += ["## Test 8: a second model", "",
              "The same command on another model, then `structlm experiment transfer` "
              "puts the two side by side finding by finding (docs/share.md).", ""]
    lines += ["![perplexity vs budget](ppl_vs_budget.png)", "",
              "![energy vs perplexity](energy_vs_ppl.png)", "",
              "![fine-tuning curves](finetune_curves.png)", "",
              f"Total time {res['seconds'] / 60:.1f} min (arms reused from arms.json are not "
              "re-timed; each arm's own time is in experiment.json).", ""]
    atomic_write_text(out / "report.md", "\n".join(lines))
