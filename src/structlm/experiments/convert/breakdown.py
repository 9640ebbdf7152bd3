"""Where the error of the converted arms sits, for the report of ``structlm experiment
convert``: per projection kind, per position type and per layer, right after the change
and after healing (from :func:`structlm.convert.diagnose.module_errors`), and a plot of
the per-layer error after healing."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from structlm.plotting import save_figure

__all__ = ["breakdown_lines", "plot_breakdown"]

_LAYER = re.compile(r"\.(?:layers|h)\.(\d+)\.")


def _where(name: str) -> tuple[int, str]:
    """``(layer, projection kind)`` of a module name (``model.layers.3.mlp.up_proj``)."""
    m = _LAYER.search(name)
    return (int(m.group(1)) if m else -1), name.rsplit(".", 1)[-1]


def _by(errors: dict[str, dict[str, Any]], key: str, part: int, how: Any = statistics.median
        ) -> dict[Any, float]:
    """``how`` (median by default: one outlying layer must not stand for all) of
    ``errors[*][key]`` grouped by layer (``part`` 0) or kind (``part`` 1)."""
    groups: dict[Any, list[float]] = {}
    for name, e in errors.items():
        groups.setdefault(_where(name)[part], []).append(e[key])
    return {k: how(v) for k, v in groups.items()}


def _per_type(errors: dict[str, dict[str, Any]], key: str) -> list[float]:
    rows = [e[key + "_per_type"] for e in errors.values()]
    return [statistics.fmean(col) for col in zip(*rows, strict=True)]


def _first_runs(arms: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (target, arm), its first run that has the per-module errors."""
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    for a in arms:
        if "module_errors_healed" in a:
            runs.setdefault((a["target"], a["arm"]), a)
    return runs


def _cell(changed: dict[str, Any], healed: dict[str, Any], key: str, kind: str) -> str:
    """``median [max]`` over the layers, changed → healed."""
    return (f"{_by(changed, key, 1)[kind]:.3f} [{_by(changed, key, 1, max)[kind]:.3f}] → "
            f"{_by(healed, key, 1)[kind]:.3f} [{_by(healed, key, 1, max)[kind]:.3f}]")


def breakdown_lines(arms: list[dict[str, Any]]) -> list[str]:
    """The report section: one block per algebra arm (its first seed) that has the
    per-module errors."""
    runs = _first_runs(arms)
    if not runs:
        return []
    lines = ["## Where the error sits", "",
             "Relative error of every converted module against the dense model on 8 "
             "held-out in-domain windows (4,096 tokens): *local* = `|y - A x|² / |A x|²` "
             "on the module's own input (`A` the dense weight), *drift* = `|y - y_dense|² "
             "/ |y_dense|²` at its place in the model (every earlier module's error "
             "included). Medians over the layers [largest], right after the change → after "
             "healing (first seed); per type and per layer, means.", ""]
    for (target, arm), r in runs.items():
        ch, he = r["module_errors_changed"], r["module_errors_healed"]
        lines += [f"### {arm} ({target})", "",
                  "| projection | local | drift |", "|---|---:|---:|"]
        for kind in _by(he, "local", 1):
            lines.append(f"| {kind} | {_cell(ch, he, 'local', kind)} | "
                         f"{_cell(ch, he, 'drift', kind)} |")
        types_c, types_h = _per_type(ch, "drift"), _per_type(he, "drift")
        lines += ["", "Drift per position type: " + ", ".join(
            f"type {t}: {c:.3f} → {h:.3f}" for t, (c, h) in enumerate(
                zip(types_c, types_h, strict=True))) + ".", ""]
        layers = _by(he, "drift", 0, statistics.fmean)
        worst = sorted(layers, key=layers.__getitem__, reverse=True)[:5]
        lines += ["Largest drift after healing (layer: mean over its projections): "
                  + ", ".join(f"{k}: {layers[k]:.3f}" for k in worst) + ".", ""]
    lines += ["![per-layer error after healing](module_errors.png)", ""]
    return lines


def plot_breakdown(arms: list[dict[str, Any]], path: Path) -> None:
    """Per-layer local and drift error after healing, one line per projection kind, one
    row of panels per algebra arm (first seed)."""
    from structlm.plotting import pyplot

    runs = _first_runs(arms)
    if not runs:
        return
    plt = pyplot()
    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 3.2 * len(runs)), squeeze=False)
    for row, ((target, arm), r) in zip(axes, runs.items(), strict=True):
        errs = r["module_errors_healed"]
        kinds = sorted({_where(n)[1] for n in errs})
        for ax, key in zip(row, ("local", "drift"), strict=True):
            for kind in kinds:
                pts = sorted((_where(n)[0], e[key]) for n, e in errs.items()
                             if _where(n)[1] == kind)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", lw=1,
                        label=kind)
            ax.set_yscale("log")
            ax.set_xlabel("layer")
            ax.set_ylabel(f"{key} relative error")
            ax.set_title(f"{arm} ({target}), after healing: {key}", fontsize=9)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
