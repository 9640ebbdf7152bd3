"""Report of ``structlm share analyze``: ``results.json`` (every number), ``report.md``
(the seed's table layout: test, key number, null, verdict; test 3 also as one table per
covariance variant: type | m per draw | mean [95% interval] | verdict) and plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from structlm.atomic import atomic_write_text, clean_json
from structlm.stats import Interval

__all__ = ["ONE_NULL_DRAW", "functional_tables", "verdict_table", "write_report"]


def _f(x: float | None, nd: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) \
        else f"{x:.{nd}f}"


def _drop(d: dict[str, Any]) -> str:
    return (f"{_f(d['total'])} (perm {_f(d['permutation'])} + diag "
            f"{_f(d['diagonal'])})")


ONE_NULL_DRAW = "one null draw: no interval"
"""How tests 1–2's verdicts are marked: measured against one null draw."""

VARIANT_NAMES = {"centred": "centred covariance", "uncentred": "uncentred E[x xᵀ]",
                 "sink_excluded": "sinks excluded"}


def _interval(d: dict[str, Any] | None) -> str:
    """A margin's mean and interval (``Interval.text``) from its JSON form."""
    if not d:
        return "n/a"
    return Interval(**d).text()


def _subspace_row(num: int, name: str, t: str, s: dict[str, Any]) -> str:
    """Test 2's row (one null draw)."""
    er = s["output"]["real"]["effective_rank"]
    ov_in, ov_out = s["input"]["real"], s["output"]["real"]
    return (f"| {num} {name} | {t} | score {_f(s['score'])} (input "
            f"{_f(ov_in['score'])}, output {_f(ov_out['score'])}); k_in={s['k_input']}, "
            f"k_out={s['k_output']}; overlaps in/out {_f(ov_in['overlap_all_pairs'])}/"
            f"{_f(ov_out['overlap_all_pairs'])} all pairs; eff. rank {min(er)}–{max(er)} | "
            f"{_f(s['null_score'])}; chance overlap {_f(ov_in['overlap_chance'])}/"
            f"{_f(ov_out['overlap_chance'])} | {s['verdict']} ({ONE_NULL_DRAW}) |")


def _functional_row(t: str, f: dict[str, Any], variant: str) -> str:
    """Test 3's row of one variant: the margin over draws, the mean scores, the verdict."""
    v = f["variants"][variant]
    primary = ", primary" if v.get("primary") else ""
    name = f"| 3 functional subspaces ({VARIANT_NAMES[variant]}{primary}) | {t} |"
    if "skipped" in v:
        return f"{name} skipped: {v['skipped']} | | |"
    d0 = f["draws"][str(f["calib_seeds"][0])][variant]
    er = d0["output"]["real"]["effective_rank"]
    return (f"{name} m = {_interval(v['margin'])}; score {_f(v['score_mean'])} (mean over "
            f"{len(v['margin_per_draw'])} draws); k_in={f['k_input']}, k_out={f['k_output']}; "
            f"eff. rank {min(er)}–{max(er)} (draw {f['calib_seeds'][0]}) | "
            f"{_f(v['null_score_mean'])} | {v['verdict']} |")


def _rows(results: dict[str, Any]) -> list[str]:
    rows = []
    tests = results["tests"]
    for t, r in tests.items():
        if "alignment" not in r:
            continue
        a = r["alignment"]["median"]
        d = r["alignment"].get("cheap_drop")
        drop = f"; drop from scale {_drop(d['real'])}" if d else ""
        ndrop = (f"; drop {_drop(d['null_gaussian'])}, same-spectrum "
                 f"{_f(d['null_spectrum']['total'])}") if d else ""
        rows.append(f"| 1 alignment | {t} | cheap moves {_f(a['real']['perm_diag'])}{drop}; "
                    f"rot1 {_f(a['real']['rot1'])}; rot2 {_f(a['real']['rot2'])} | "
                    f"{_f(a['null_gaussian']['perm_diag'])}{ndrop}; "
                    f"{_f(a['null_gaussian']['rot1'])}; {_f(a['null_gaussian']['rot2'])} "
                    f"(same-spectrum rot2 {_f(a['null_spectrum']['rot2'])}) | "
                    f"{r['alignment']['verdict']} ({ONE_NULL_DRAW}) |")
    for t, r in tests.items():
        if "weight_subspaces" in r:
            rows.append(_subspace_row(2, "weight subspaces", t, r["weight_subspaces"]))
    for t, r in tests.items():
        if "functional" in r:
            rows.append(_functional_row(t, r["functional"], r["functional"]["primary"]))
    roles = results.get("roles", {})
    shape = roles.get("shape_only", {})
    for key, label in (("attention_to_mlp", "attention → MLP"),
                       ("mlp_to_attention", "MLP → attention")):
        if key in roles:
            r = roles[key]
            ctrl = (f"; shape-only control {_f(shape[key]['accuracy'])} (p = "
                    f"{_f(shape[key]['p_value'])})") if key in shape else ""
            rows.append(f"| role signature | {label} | accuracy {_f(r['accuracy'])}, "
                        f"p = {_f(r['p_value'])} | majority {_f(r['majority_rate'])}; "
                        f"shuffled {_f(r['null_mean_accuracy'])}{ctrl} | "
                        f"{'transfers' if r['transfers'] else 'does not transfer'} |")
    return rows


def functional_tables(results: dict[str, Any]) -> str:
    """Test 3 over the calibration draws, one Markdown table per covariance variant (the
    primary first): type | m per draw | mean [95% interval] | score / null | verdict."""
    funcs = {t: r["functional"] for t, r in results["tests"].items() if "functional" in r}
    if not funcs:
        return ""
    first = next(iter(funcs.values()))
    order = [first["primary"], *(v for v in first["variants"] if v != first["primary"])]
    out = []
    for variant in order:
        primary = " (primary)" if variant == first["primary"] else ""
        out += [f"### {VARIANT_NAMES[variant]}{primary}", "",
                "| type | m per draw | mean [95% interval] | score / null (means) | verdict |",
                "|---|---|---|---|---|"]
        for t, f in funcs.items():
            v = f["variants"][variant]
            if "skipped" in v:
                out.append(f"| {t} | skipped: {v['skipped']} | | | |")
                continue
            per = ", ".join(_f(m) for m in v["margin_per_draw"])
            out.append(f"| {t} | {per} | {_interval(v['margin'])} | "
                       f"{_f(v['score_mean'])} / {_f(v['null_score_mean'])} | "
                       f"{v['verdict']} |")
        out.append("")
    return "\n".join(out)


def verdict_table(results: dict[str, Any]) -> str:
    """The table of tests, key numbers, nulls and verdicts as Markdown."""
    return "\n".join(["| test | type | key number | null | verdict |",
                      "|---|---|---|---|---|", *_rows(results)])


def _markdown(results: dict[str, Any], cfg: Any, plots: tuple[str, ...] = ()) -> str:
    th = cfg.thresholds
    tests = results["tests"]
    ran = set(results.get("analysis_tests", (1, 2, 3)))
    lines = [f"# Shared functional bases — analysis of {results['model']}", ""]
    if results.get("model_note"):
        lines += [f"**Note:** {results['model_note']}.", ""]
    if results.get("architecture_notes"):
        lines += [f"**Architecture** (`{results.get('model_type', '')}`): "
                  f"{results['architecture_notes']}.", ""]
    lines += [f"Family `{results['family']}`, {results['num_layers']} layers, hidden size "
              f"{results['hidden_size']}; analysed layers {results['layers']}; tests "
              f"{', '.join(map(str, sorted(ran)))}; calibration "
              f"{results['calibration'].get('tokens_used')} tokens of `{cfg.corpus}` "
              f"(documents {', '.join(results['split']['calibration_documents'][:8])}"
              f"{' …' if len(results['split']['calibration_documents']) > 8 else ''}).", ""]
    rules = []
    if 1 in ran:
        rules.append(f"test 1 lives if the median cheap-move residual ≤ "
                     f"{th.alignment_max_residual} and ≥ {th.alignment_min_margin} below the "
                     "Gaussian null (one null draw: no interval)")
    if 2 in ran:
        rules.append(f"test 2 lives if the score ≥ {th.subspace_min_score} and ≥ "
                     f"{th.subspace_min_margin} above the null control's score (one null "
                     "draw: no interval)")
    if 3 in ran:
        rules.append(f"test 3 lives if the 95% Student-t interval over the calibration draws "
                     f"of the normalised margin m = (score − null)/(1 − null) lies above "
                     f"{th.functional_min_margin} (the real matrices close at least half of "
                     "the gap between the null and the ceiling), fails if it lies below, "
                     f"and is undecided otherwise; no verdict under "
                     f"{th.functional_min_draws} draws (draws {cfg.calib_seeds})")
    if "roles" in results:
        rules.append(f"the role signature transfers if accuracy > majority rate with p ≤ "
                     f"{th.classifier_max_p}")
    lines += ["Thresholds fixed before the run: " + "; ".join(rules) + ".", "",
              verdict_table(results), ""]
    if any("functional" in r for r in tests.values()):
        secs = results.get("functional_draw_seconds", {})
        lines += ["## Test 3 over calibration draws", "",
                  "Each draw: calibration windows drawn from the same calibration documents "
                  "(draw 0 is the analysis's own calibration), its own Gaussian nulls and "
                  "random bases (seeded from the draw); m per draw is (score − null)/"
                  "(1 − null), mean over layers and both sides; the interval is Student-t "
                  "95% over the draws." + (" Seconds per draw (calibration, sink pass and "
                                           "test 3; draw 0's calibration is in the "
                                           "preparation): " + ", ".join(
                                               f"draw {d}: {v:.0f}" for d, v in secs.items())
                                           + "." if secs else ""), "",
                  functional_tables(results), "![margins](functional_margins.png)", ""]
    if results.get("perplexity"):
        lines += ["## Perplexity of the unmodified model", "",
                  "| text | ppl | tokens | window |", "|---|---|---|---|"]
        for name, p in results["perplexity"].items():
            lines.append(f"| {name} | {_f(p['ppl'], 2)} | {p['tokens']} | {p['window']} |")
        lines.append("")
    fc = results.get("functional_covariances", {})
    sink = (f"the first {fc['sink_tokens']} positions of every calibration window left out"
            if fc.get("sink_tokens") else "not run (`sink_pass: false`)")
    read = []
    if 1 in ran:
        ref = next(iter(tests.values()))["alignment"]["reference_layer"]
        read += ["* Test 1 residuals are medians over layers of the relative residual energy "
                 f"after aligning each layer to the reference layer {ref}; cheap moves = "
                 "row/column permutations + diagonal scalings.",
                 "* Test 1's cheap-move drop is measured from the `scale` baseline (best global "
                 "scale, no move) and split into the permutation part (scale → perm) and the "
                 "diagonal part (perm → perm_diag), medians over layers; the null column gives "
                 "the same drop for the Gaussian null (and the total for the same-spectrum "
                 "null) — only a drop well above the null's is structure. The raw residual "
                 "(no move, no scale) is kept in `results.json` for information only: it is ≈ 2 "
                 "for any two near-orthogonal matrices of equal norm, so a drop measured from "
                 "it is mostly 'norm scaling' for random matrices too.",
                 "* `rot2` (two-sided rotations) equals 1 − (σ_R·σ_W)²/(‖R‖²‖W‖²): it sees "
                 "only the two singular spectra (any two matrices with equal spectra score 0), "
                 "so it measures how alike the two spectra are, not shared structure, and is "
                 "**not comparable to the seed's 0.693** (GPT-2 small Q: another model, and a "
                 "two-sided fit the seed does not specify)."]
    if ran & {2, 3}:
        read += ["* Tests 2–3: score = (shared − random)/(own − random) energy, mean over "
                 "layers and the two sides, with k per side (k_in = in/4 on the input side, "
                 "k_out = out/4 on the output side; when k exceeds the rank the own subspace "
                 "is the whole column space); the null control is a Gaussian matrix of the "
                 "same shape and norm per layer through the identical procedure (for test 3 "
                 "with the real layer's input covariance)."]
    if 3 in ran:
        read += ["* Test 3's statistic is the normalised margin m = (score − null)/(1 − null): "
                 "the share of the gap between the null control and the ceiling (score 1) "
                 "that the real matrices close (a raw difference score − null cannot reach a "
                 "fixed margin when the null is high). It runs on three input covariances, "
                 "each with its own null and verdict: the centred covariance E[x xᵀ] − μμᵀ "
                 "(**primary**), the uncentred second moment E[x xᵀ] (its dominant mean "
                 "direction can collapse the functional effective ranks and lifts real and "
                 f"null scores alike), and E[x xᵀ] with {sink}.",
                 f"* Effective rank: directions holding {cfg.energy:.0%} of the energy "
                 "(output side)."]
    if "roles" in results and "skipped" not in results["roles"]:
        read += ["* Role signature: shape-free features (each has the same expectation for "
                 "Gaussian matrices of any shape); the shape-only control is the same "
                 "transfer test on (out, in, out/in) alone."]
    lines += ["## Reading the table", "", *read, ""]
    for name, title in (("energy.png", "energy"), ("effective_ranks.png", "effective ranks"),
                        ("alignment_distance.png", "alignment vs distance")):
        if name in plots:
            lines += [f"![{title}]({name})", ""]
    return "\n".join(lines)


def _first_draw(f: dict[str, Any], variant: str) -> dict[str, Any]:
    return f["draws"][str(f["calib_seeds"][0])][variant]


def _plots(results: dict[str, Any], out: Path) -> tuple[str, ...]:
    """The plots the results allow; returns the files written."""
    from structlm.plotting import pyplot

    plt = pyplot()
    written = []
    tests = results["tests"]
    layers = results["layers"]
    has2 = all("weight_subspaces" in r for r in tests.values())
    has3 = all("functional" in r for r in tests.values())
    rows = [("weights", lambda r: r["weight_subspaces"])] if has2 else []
    if has3:
        rows.append(("function", lambda r: _first_draw(r["functional"],
                                                       r["functional"]["primary"])))
    if rows:
        fig, axes = plt.subplots(len(rows), len(tests), figsize=(3.2 * len(tests),
                                                                 3 * len(rows)),
                                 squeeze=False)
        for col, (t, r) in enumerate(tests.items()):
            for row, (label, get) in enumerate(rows):
                ax = axes[row][col]
                s = get(r)["output"]
                for name, style in (("own", "-"), ("shared", "-"), ("random", ":")):
                    ax.plot(layers, s["real"][name], style, label=name)
                ax.plot(layers, s["null"]["shared"], "--", label="shared (null)")
                ax.set_title(f"{t}: {label}", fontsize=9)
                ax.set_ylim(0, 1.02)
                ax.set_xlabel("layer", fontsize=8)
        axes[0][0].set_ylabel("energy captured (output side)")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "energy.png", dpi=110)
        plt.close(fig)
        written.append("energy.png")

    if has3:
        first = next(iter(tests.values()))["functional"]
        variants = [v for v in first["variants"] if "skipped" not in first["variants"][v]]
        fig, axes = plt.subplots(1, len(variants), figsize=(5 * len(variants), 4),
                                 squeeze=False)
        for ax, variant in zip(axes[0], variants, strict=True):
            for t, r in tests.items():
                style = {}
                if has2:
                    line = ax.plot(layers, r["weight_subspaces"]["output"]["real"]
                                   ["effective_rank"], "--", alpha=0.6)[0]
                    style = {"color": line.get_color()}
                ax.plot(layers, _first_draw(r["functional"], variant)["output"]["real"]
                        ["effective_rank"], "-", label=t, **style)
            ax.set_yscale("log")
            ax.set_xlabel("layer")
            ax.set_title(f"{variant}: function" + (" (solid) vs weights (dashed)" if has2
                                                   else ""), fontsize=9)
        axes[0][0].set_ylabel("effective rank (90% energy)")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "effective_ranks.png", dpi=110)
        plt.close(fig)
        written.append("effective_ranks.png")

        # the margins per type with their intervals, the pre-set threshold
        fig, axes = plt.subplots(1, len(variants), figsize=(4.5 * len(variants), 3.6),
                                 squeeze=False, sharey=True)
        names = list(tests)
        for ax, variant in zip(axes[0], variants, strict=True):
            for x, t in enumerate(names):
                v = tests[t]["functional"]["variants"][variant]
                per = v["margin_per_draw"]
                ax.plot([x - 0.18] * len(per), per, ".", color="0.45", ms=5,
                        label="per draw" if x == 0 else None)
                iv = v.get("margin")
                if iv:
                    colour = {"lives": "tab:green", "fails": "tab:red"}.get(v["verdict"],
                                                                           "tab:gray")
                    ax.errorbar([x], [iv["mean"]], yerr=[[iv["mean"] - iv["lo"]],
                                                         [iv["hi"] - iv["mean"]]],
                                fmt="o", color=colour, capsize=4)
            ax.axhline(first["threshold"], color="k", ls="--", lw=1,
                       label=f"threshold {first['threshold']}")
            ax.axhline(0, color="0.6", lw=0.8)
            ax.set_xticks(range(len(names)), names)
            ax.set_title(VARIANT_NAMES[variant] + (" (primary)" if variant == first["primary"]
                                                   else ""), fontsize=9)
        axes[0][0].set_ylabel("m = (score − null)/(1 − null)")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "functional_margins.png", dpi=110)
        plt.close(fig)
        written.append("functional_margins.png")

    if all("alignment" in r for r in tests.values()):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for t, r in tests.items():
            pl = r["alignment"]["per_layer"].values()
            d = [v["distance"] for v in pl]
            for ax, move in zip(axes, ("perm_diag", "rot1"), strict=True):
                pts = sorted(zip(d, [v["real"][move] for v in pl], strict=True))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=t)
        for ax, move in zip(axes, ("cheap moves (perm + diag)", "one-sided rotation"),
                            strict=True):
            ax.set_xlabel("distance to reference layer")
            ax.set_ylabel("residual relative energy")
            ax.set_title(move)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "alignment_distance.png", dpi=110)
        plt.close(fig)
        written.append("alignment_distance.png")
    return tuple(written)


def write_report(results: dict[str, Any], cfg: Any, out: Path) -> None:
    """Write ``results.json``, ``report.md`` and the PNG plots into ``out``."""
    atomic_write_text(out / "results.json", json.dumps(clean_json(results), indent=1))
    plots = _plots(results, out)
    atomic_write_text(out / "report.md", _markdown(results, cfg, plots))
