"""Report of ``structlm share experiment``: the seed's table (test, key number,
baseline, verdict), the energy-vs-perplexity plot and the fine-tuning curves."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from ..report import atomic_write_text

__all__ = ["write_experiment_report"]


def _f(x: float | None, nd: int = 2) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{nd}f}"


def _ft(s: dict[str, float]) -> str:
    return "—" if not s else f"{s['mean']:.2f} ± {s['std']:.2f} (n={s['n']})"


def _recovered(orig: float, analytic: float, tuned: float) -> float:
    """Share of the compression's log-perplexity damage undone by fine-tuning."""
    gap = math.log(analytic) - math.log(orig)
    return (math.log(analytic) - math.log(tuned)) / gap if gap > 1e-9 else float("nan")


def _rows(res: dict[str, Any], name: str) -> list[str]:
    orig = res["ppl_original"][name]
    rows = []
    by = {(e["method"], e["reduction"]): e for e in res["attention"]}
    reds = sorted({e["reduction"] for e in res["attention"]})
    for red in reds:
        sh, sv = by.get(("shared", red)), by.get(("svd", red))
        if sh and sv:
            a, b = sh["analytic"][name], sv["analytic"][name]
            rows.append(f"| 4 analytic, attention −{red:.0%} | shared {_f(a)} "
                        f"({sh['arms'][0]['ratio']:.2f}×) | svd {_f(b)}; original {_f(orig)} | "
                        f"{'shared ≤ svd' if a <= b else 'svd better'} |")
        if sh and sh["finetuned"]:
            rec = _recovered(orig, sh["analytic"][name], sh["finetuned"]["mean"])
            rows.append(f"| 5 core fine-tuning, −{red:.0%} | shared {_ft(sh['finetuned'])}, "
                        f"{_f(100 * rec, 0)}% of the damage recovered | analytic "
                        f"{_f(sh['analytic'][name])} | {'lives' if rec >= 0.5 else 'fails'} |")
        tuned = {m: by[(m, red)]["finetuned"] for m in ("shared", "hybrid", "svd", "onesided")
                 if (m, red) in by and by[(m, red)]["finetuned"]}
        if "shared" in tuned and len(tuned) > 1:
            best_base = min((m for m in tuned if m in ("svd", "onesided")),
                            key=lambda m: tuned[m]["mean"], default=None)
            fam = min((m for m in tuned if m in ("shared", "hybrid")),
                      key=lambda m: tuned[m]["mean"])
            if best_base:
                f, b = tuned[fam], tuned[best_base]
                verdict = ("sharing wins" if f["max"] < b["min"] else
                           "baseline wins" if b["max"] < f["min"] else "ranges overlap")
                rows.append(f"| 6 same budget, −{red:.0%} | {fam} {_ft(f)} | {best_base} "
                            f"{_ft(b)} | {verdict} |")
    for arm in res["scope"]:
        tuned = arm.get("ppl_finetuned", {}).get(name)
        extra = ""
        if arm["residual_share_of_basis_error"]:
            cover = sum(arm["residual_share_of_basis_error"].values()) / len(
                arm["residual_share_of_basis_error"])
            extra = f"; residual covers {cover:.0%} of the basis error"
        test = 9 if arm["method"] == "hybrid" else 7
        usable = "usable (≤ 2× original)" if tuned and tuned <= 2 * orig else "not usable"
        rows.append(f"| {test} {arm['method']} on {arm['types']} | {arm['ratio']:.2f}×: "
                    f"analytic {_f(arm['ppl_analytic'][name])}, fine-tuned {_f(tuned)}{extra} "
                    f"| original {_f(orig)} | {usable} |")
    sm = res["second_model"]
    if "arm" in sm:
        a = sm["arm"]
        o2 = next(iter(sm["ppl_original"].values()))
        rows.append(f"| 8 second model {sm['model']} | attention {a['ratio']:.2f}×: "
                    f"{_f(next(iter(a.get('ppl_finetuned', a['ppl_analytic']).values())))} | "
                    f"original {_f(o2)} | see numbers |")
    else:
        rows.append(f"| 8 second model | not run | — | {sm['skipped']} |")
    return rows


def _plots(res: dict[str, Any], out: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for e in res["attention"]:
        a = e["arms"][0]
        en = sum(a["energy_kept"].values()) / len(a["energy_kept"])
        ax.scatter(en, a["ppl_analytic"][name], label=f"{e['method']} −{e['reduction']:.0%}")
    for a in res["scope"]:
        en = sum(a["energy_kept"].values()) / len(a["energy_kept"])
        ax.scatter(en, a["ppl_analytic"][name], marker="x", label=f"{a['method']} {a['types']}")
    ax.axhline(res["ppl_original"][name], color="k", lw=0.8, ls="--", label="original")
    ax.set_yscale("log")
    ax.set_xlabel("functional energy kept (mean over compressed types)")
    ax.set_ylabel(f"perplexity before fine-tuning ({name})")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "energy_vs_ppl.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for e in res["attention"]:
        for arm in e["arms"]:
            curve = arm.get("curve") or []
            lbl = f"{e['method']} −{e['reduction']:.0%}" if arm is e["arms"][0] else None
            steps = [c["step"] for c in curve if c["loss"] is not None]
            line = axes[0].plot(steps, [c["loss"] for c in curve if c["loss"] is not None],
                                lw=0.8, label=lbl)[0]
            ev = [c for c in curve if c["eval_ppl"] is not None]
            axes[1].plot([c["step"] for c in ev], [c["eval_ppl"] for c in ev], "o-", ms=3,
                         lw=0.8, color=line.get_color(), label=lbl)
    axes[0].set_title("training loss (every seed)")
    axes[1].set_title("held-out perplexity during fine-tuning")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("step")
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "finetune_curves.png", dpi=110)
    plt.close(fig)


def _arm_table(res: dict[str, Any]) -> list[str]:
    """Every attention arm: budget, energy, perplexity on each text, analytic and after
    fine-tuning (mean ± sample std over seeds)."""
    texts = list(res["ppl_original"])
    head = " | ".join(f"{t} analytic | {t} fine-tuned" for t in texts)
    lines = ["## Every attention arm", "",
             "In-domain = held-out Austen novels (the calibration and fine-tuning text is "
             "other Austen novels); other-domain = Shakespeare, never seen in calibration "
             "or fine-tuning.", "",
             f"| method | reduction | stored / original | mean energy kept | {head} |",
             "|---|---|---|---|" + "---|---|" * len(texts),
             "| original | — | 1 | 1 | " + " | ".join(
                 f"{_f(res['ppl_original'][t])} | —" for t in texts) + " |"]
    for e in res["attention"]:
        a0 = e["arms"][0]
        energy = sum(a0["energy_kept"].values()) / len(a0["energy_kept"])
        cells = []
        for t in texts:
            tuned = [a["ppl_finetuned"][t] for a in e["arms"] if "ppl_finetuned" in a]
            if tuned:
                mean = statistics.fmean(tuned)
                std = statistics.stdev(tuned) if len(tuned) > 1 else 0.0
                cells.append(f"{_f(a0['ppl_analytic'][t])} | {mean:.2f} ± {std:.2f}")
            else:
                cells.append(f"{_f(a0['ppl_analytic'][t])} | —")
        lines.append(f"| {e['method']} | {e['reduction']:.0%} | "
                     f"{a0['stored_parameters'] / a0['original_parameters']:.3f} | "
                     f"{energy:.3f} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def write_experiment_report(res: dict[str, Any], cfg: Any, out: Path) -> None:
    """``report.md`` and the two plots."""
    name = next(iter(res["ppl_original"]))
    _plots(res, out, name)
    lines = [f"# Shared functional bases — tests 4–9 on {res['model']}", ""]
    if res.get("model_note"):
        lines += [f"**Note:** {res['model_note']}.", ""]
    lines += [f"Perplexity on `{name}` (in-domain, held-out documents; calibration and "
              f"fine-tuning use the calibration documents only). Budgets: reductions "
              f"{cfg.reductions} of the attention matrices' parameters, fine-tuning "
              f"{cfg.finetune.steps} steps × {cfg.finetune.batch_size} × "
              f"{cfg.finetune.seq_len} tokens, seeds {cfg.seeds}. Verdict rules fixed "
              "in advance: test 5 lives if fine-tuning undoes ≥ 50% of the log-perplexity "
              "damage; test 6 needs non-overlapping seed ranges; tests 7/9 call a model "
              "usable within 2× the original perplexity.", "",
              "| test | key number | baseline | verdict |", "|---|---|---|---|",
              *_rows(res, name), ""]
    lines += _arm_table(res)
    lines += ["![energy vs perplexity](energy_vs_ppl.png)", "",
              "![fine-tuning curves](finetune_curves.png)", "",
              f"Total time {res['seconds'] / 60:.1f} min.", ""]
    atomic_write_text(out / "report.md", "\n".join(lines))
