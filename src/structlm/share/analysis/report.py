"""Report of ``structlm share analyze``: ``results.json`` (every number), ``report.md``
(the seed's table layout: test, key number, null, verdict) and plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from structlm.atomic import atomic_write_text, clean_json

__all__ = ["verdict_table", "write_report"]


def _f(x: float | None, nd: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) \
        else f"{x:.{nd}f}"


def _drop(d: dict[str, Any]) -> str:
    return (f"{_f(d['total'])} (perm {_f(d['permutation'])} + diag "
            f"{_f(d['diagonal'])})")


_FUNCTIONAL = (("functional_subspaces", "functional subspaces"),
               ("functional_subspaces_centred", "functional, centred"),
               ("functional_subspaces_sink_excluded", "functional, sinks excluded"))


def _subspace_row(num: int, name: str, t: str, s: dict[str, Any]) -> str:
    if "skipped" in s:
        return f"| {num} {name} | {t} | skipped: {s['skipped']} | | |"
    er = s["output"]["real"]["effective_rank"]
    ov_in, ov_out = s["input"]["real"], s["output"]["real"]
    primary = " (primary)" if s.get("primary") else ""
    return (f"| {num} {name}{primary} | {t} | score {_f(s['score'])} (input "
            f"{_f(ov_in['score'])}, output {_f(ov_out['score'])}); k_in={s['k_input']}, "
            f"k_out={s['k_output']}; overlaps in/out {_f(ov_in['overlap_all_pairs'])}/"
            f"{_f(ov_out['overlap_all_pairs'])} all pairs; eff. rank {min(er)}–{max(er)} | "
            f"{_f(s['null_score'])}; chance overlap {_f(ov_in['overlap_chance'])}/"
            f"{_f(ov_out['overlap_chance'])} | {s['verdict']} |")


def _rows(results: dict[str, Any]) -> list[str]:
    rows = []
    for t, r in results["tests"].items():
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
                    f"{r['alignment']['verdict']} |")
    for t, r in results["tests"].items():
        rows.append(_subspace_row(2, "weight subspaces", t, r["weight_subspaces"]))
    for key, name in _FUNCTIONAL:
        for t, r in results["tests"].items():
            if key in r:
                rows.append(_subspace_row(3, name, t, r[key]))
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


def verdict_table(results: dict[str, Any]) -> str:
    """The table of tests, key numbers, nulls and verdicts as Markdown."""
    return "\n".join(["| test | type | key number | null | verdict |",
                      "|---|---|---|---|---|", *_rows(results)])


def _markdown(results: dict[str, Any], cfg: Any) -> str:
    th = cfg.thresholds
    lines = [f"# Shared functional bases — analysis of {results['model']}", ""]
    if results.get("model_note"):
        lines += [f"**Note:** {results['model_note']}.", ""]
    if results.get("architecture_notes"):
        lines += [f"**Architecture** (`{results.get('model_type', '')}`): "
                  f"{results['architecture_notes']}.", ""]
    lines += [f"Family `{results['family']}`, {results['num_layers']} layers, hidden size "
              f"{results['hidden_size']}; analysed layers {results['layers']}; calibration "
              f"{results['calibration'].get('tokens_used')} tokens of `{cfg.corpus}` "
              f"(documents {', '.join(results['split']['calibration_documents'][:8])}"
              f"{' …' if len(results['split']['calibration_documents']) > 8 else ''}).", "",
              "Thresholds fixed before the run: test 1 lives if the median cheap-move "
              f"residual ≤ {th.alignment_max_residual} and ≥ {th.alignment_min_margin} below "
              f"the Gaussian null; tests 2–3 live if the score ≥ {th.subspace_min_score} and "
              f"≥ {th.subspace_min_margin} above the null control's score; the role "
              f"signature transfers if accuracy > majority rate with p ≤ "
              f"{th.classifier_max_p}.", "",
              verdict_table(results), ""]
    if results.get("perplexity"):
        lines += ["## Perplexity of the unmodified model", "",
                  "| text | ppl | tokens | window |", "|---|---|---|---|"]
        for name, p in results["perplexity"].items():
            lines.append(f"| {name} | {_f(p['ppl'], 2)} | {p['tokens']} | {p['window']} |")
        lines.append("")
    fc = results.get("functional_covariances", {})
    sink = (f"the first {fc['sink_tokens']} positions of every calibration window left out "
            f"({fc.get('sink_pass_positions')} positions kept)" if fc.get("sink_tokens")
            else "not run (`sink_pass: false`)")
    lines += ["## Reading the table", "",
              "* Test 1 residuals are medians over layers of the relative residual energy "
              "after aligning each layer to the reference layer "
              f"{next(iter(results['tests'].values()))['alignment']['reference_layer']}; "
              "cheap moves = row/column permutations + diagonal scalings.",
              "* Test 1's cheap-move drop is measured from the `scale` baseline (best global "
              "scale, no move) and split into the permutation part (scale → perm) and the "
              "diagonal part (perm → perm_diag), medians over layers; the null column gives "
              "the same drop for the Gaussian null (and the total for the same-spectrum "
              "null) — only a drop well above the null's is structure. The raw residual "
              "(no move, no scale) is kept in `results.json` for information only: it is ≈ 2 "
              "for any two near-orthogonal matrices of equal norm, so a drop measured from it "
              "is mostly 'norm scaling' for random matrices too.",
              "* `rot2` (two-sided rotations) equals 1 − (σ_R·σ_W)²/(‖R‖²‖W‖²): it sees "
              "only the two singular spectra (any two matrices with equal spectra score 0), "
              "so it measures how alike the two spectra are, not shared structure, and is "
              "**not comparable to the seed's 0.693** (GPT-2 small Q: another model, and a "
              "two-sided fit the seed does not specify).",
              "* Tests 2–3: score = (shared − random)/(own − random) energy, mean over "
              "layers and the two sides, with k per side (k_in = in/4 on the input side, "
              "k_out = out/4 on the output side; when k exceeds the rank the own subspace is "
              "the whole column space); the null control is a Gaussian matrix of the same "
              "shape and norm per layer through the identical procedure (for test 3 with "
              "the real layer's input covariance).",
              "* Test 3 runs on three input covariances, each with its own null and its "
              "verdict by the same thresholds: the uncentred second moment E[x xᵀ] "
              "(**primary**, as in earlier reports; a dominant mean / attention-sink "
              "direction in it can collapse the functional effective ranks), the centred "
              f"covariance E[x xᵀ] − μμᵀ, and E[x xᵀ] with {sink}.",
              f"* Effective rank: directions holding {cfg.energy:.0%} of the energy "
              "(output side).",
              "* Role signature: shape-free features (each has the same expectation for "
              "Gaussian matrices of any shape); the shape-only control is the same transfer "
              "test on (out, in, out/in) alone.", "",
              "![energy](energy.png)", "", "![effective ranks](effective_ranks.png)", "",
              "![alignment vs distance](alignment_distance.png)", ""]
    return "\n".join(lines)


def _plots(results: dict[str, Any], out: Path) -> None:
    from structlm.plotting import pyplot

    plt = pyplot()

    tests = results["tests"]
    layers = results["layers"]
    fig, axes = plt.subplots(2, len(tests), figsize=(3.2 * len(tests), 6), squeeze=False)
    for col, (t, r) in enumerate(tests.items()):
        for row, key in enumerate(("weight_subspaces", "functional_subspaces")):
            ax = axes[row][col]
            s = r[key]["output"]
            for name, style in (("own", "-"), ("shared", "-"), ("random", ":")):
                ax.plot(layers, s["real"][name], style, label=name)
            ax.plot(layers, s["null"]["shared"], "--", label="shared (null)")
            ax.set_title(f"{t}: {'weights' if row == 0 else 'function'}", fontsize=9)
            ax.set_ylim(0, 1.02)
            ax.set_xlabel("layer", fontsize=8)
    axes[0][0].set_ylabel("energy captured (output side)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "energy.png", dpi=110)
    plt.close(fig)

    variants = [(k, n) for k, n in _FUNCTIONAL
                if all(k in r and "skipped" not in r[k] for r in tests.values())]
    fig, axes = plt.subplots(1, len(variants), figsize=(5 * len(variants), 4),
                             squeeze=False)
    for ax, (key, name) in zip(axes[0], variants, strict=True):
        for t, r in tests.items():
            line = ax.plot(layers, r["weight_subspaces"]["output"]["real"]["effective_rank"],
                           "--", alpha=0.6)[0]
            ax.plot(layers, r[key]["output"]["real"]["effective_rank"], "-",
                    color=line.get_color(), label=t)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_title(f"{name}: function (solid) vs weights (dashed)", fontsize=9)
    axes[0][0].set_ylabel("effective rank (90% energy)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "effective_ranks.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for t, r in tests.items():
        pl = r["alignment"]["per_layer"].values()
        d = [v["distance"] for v in pl]
        for ax, move in zip(axes, ("perm_diag", "rot1"), strict=True):
            pts = sorted(zip(d, [v["real"][move] for v in pl], strict=True))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=t)
    for ax, move in zip(axes, ("cheap moves (perm + diag)", "one-sided rotation"), strict=True):
        ax.set_xlabel("distance to reference layer")
        ax.set_ylabel("residual relative energy")
        ax.set_title(move)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "alignment_distance.png", dpi=110)
    plt.close(fig)


def write_report(results: dict[str, Any], cfg: Any, out: Path) -> None:
    """Write ``results.json``, ``report.md`` and the PNG plots into ``out``."""
    atomic_write_text(out / "results.json", json.dumps(clean_json(results), indent=1))
    _plots(results, out)
    atomic_write_text(out / "report.md", _markdown(results, cfg))
