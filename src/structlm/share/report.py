"""Report of ``structlm share analyze``: ``results.json`` (every number), ``report.md``
(the seed's table layout: test, key number, null, verdict) and plots."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_text", "clean_json", "verdict_table", "write_report"]


def clean_json(x: Any) -> Any:
    """``x`` with NaN/inf floats replaced by ``None`` (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): clean_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean_json(v) for v in x]
    return x


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _f(x: float | None, nd: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) \
        else f"{x:.{nd}f}"


def _rows(results: dict[str, Any]) -> list[str]:
    rows = []
    for t, r in results["tests"].items():
        a = r["alignment"]["median"]
        rows.append(f"| 1 alignment | {t} | cheap moves {_f(a['real']['perm_diag'])}; "
                    f"rot1 {_f(a['real']['rot1'])}; rot2 {_f(a['real']['rot2'])} | "
                    f"{_f(a['null_gaussian']['perm_diag'])}; "
                    f"{_f(a['null_gaussian']['rot1'])}; {_f(a['null_gaussian']['rot2'])} "
                    f"(same-spectrum rot2 {_f(a['null_spectrum']['rot2'])}) | "
                    f"{r['alignment']['verdict']} |")
    for num, key, name in ((2, "weight_subspaces", "weight subspaces"),
                           (3, "functional_subspaces", "functional subspaces")):
        for t, r in results["tests"].items():
            s = r[key]
            er = s["output"]["real"]["effective_rank"]
            ov = s["input"]["real"]
            rows.append(f"| {num} {name} | {t} | score {_f(s['score'])} (input "
                        f"{_f(s['input']['real']['score'])}, output "
                        f"{_f(s['output']['real']['score'])}); k={s['k']}; overlaps "
                        f"{_f(ov['overlap_neighbour'])} nbr / {_f(ov['overlap_all_pairs'])} "
                        f"all; eff. rank {min(er)}–{max(er)} | {_f(s['null_score'])}; chance "
                        f"overlap {_f(ov['overlap_chance'])} | {s['verdict']} |")
    roles = results.get("roles", {})
    for key, label in (("attention_to_mlp", "attention → MLP"),
                       ("mlp_to_attention", "MLP → attention")):
        if key in roles:
            r = roles[key]
            rows.append(f"| role signature | {label} | accuracy {_f(r['accuracy'])}, "
                        f"p = {_f(r['p_value'])} | majority {_f(r['majority_rate'])}; "
                        f"shuffled {_f(r['null_mean_accuracy'])} | "
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
    lines += ["## Reading the table", "",
              "* Test 1 residuals are medians over layers of the relative residual energy "
              "after aligning each layer to the reference layer "
              f"{next(iter(results['tests'].values()))['alignment']['reference_layer']}; "
              "cheap moves = row/column permutations + diagonal scalings.",
              "* Tests 2–3: score = (shared − random)/(own − random) energy, mean over "
              "layers and the two sides; the null control is a Gaussian matrix of the same "
              "shape and norm per layer through the identical procedure (for test 3 with "
              "the real layer's input covariance).",
              f"* Effective rank: directions holding {cfg.energy:.0%} of the energy "
              "(output side).", "",
              "![energy](energy.png)", "", "![effective ranks](effective_ranks.png)", "",
              "![alignment vs distance](alignment_distance.png)", ""]
    return "\n".join(lines)


def _plots(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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

    fig, ax = plt.subplots(figsize=(7, 4))
    for t, r in tests.items():
        line = ax.plot(layers, r["weight_subspaces"]["output"]["real"]["effective_rank"],
                       "--", alpha=0.6)[0]
        ax.plot(layers, r["functional_subspaces"]["output"]["real"]["effective_rank"], "-",
                color=line.get_color(), label=t)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("effective rank (90% energy)")
    ax.set_title("function (solid) vs weights (dashed)")
    ax.legend(fontsize=8)
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
