"""The study's report: per budget, per-arm results with seeds and intervals, the pre-set
comparisons (equal parameters, equal FFN MACs, wide at equal MACs, Q4 vs Q2^2, schedules,
structured scores, initialisation), the iso-quality view and per-part losses; the
learning-rate sweep and the gaps across budgets (:mod:`.report_tokens`); generation
throughput, CSVs and plots.

Comparison rule (set before any run): two arms differ only when their seed ranges
``[min, max]`` of whole-split validation loss do not overlap; otherwise the report says
the ranges overlap and claims no difference. A one-seed arm's range is its one value.
"""

from __future__ import annotations

import csv
import itertools
import math
import statistics
from pathlib import Path
from typing import Any

from structlm.atomic import atomic_write_text
from structlm.experiments.study.config import (
    ArmSpec,
    Run,
    StudyConfig,
    chosen_rates,
    run_summary,
)
from structlm.plotting import save_figure

__all__ = ["arm_stats", "comparisons", "iso_quality", "write_report"]


def arm_stats(cfg: StudyConfig, steps: int | None = None) -> dict[str, dict[str, Any]]:
    """Per arm with at least one finished run at the budget of ``steps`` training steps
    (default: the first budget), at the arm's rate: the runs and the loss statistics."""
    steps = cfg.all_budgets()[0] if steps is None else steps
    main = [r for r in cfg.main_runs(chosen_rates(cfg)) if r.steps == steps]
    out = {}
    for arm in cfg.arms:
        mine: list[Run] = [r for r in main if r.arm.name == arm.name]
        done = [(r, run_summary(cfg, r)) for r in mine]
        runs = [{**s, "_run": r} for r, s in done if s is not None]
        if not runs:
            continue
        losses = [r["val_loss"] for r in runs]
        out[arm.name] = {
            "arm": arm, "runs": runs, "n": len(runs), "planned": len(arm.seeds), "steps": steps,
            "lr": mine[0].lr,
            "mean": statistics.fmean(losses),
            "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "min": min(losses), "max": max(losses),
            "projection_macs": runs[0]["projection_macs_per_token"],
            "parameters": runs[0]["parameters"],
        }
    return out


def _reference(cfg: StudyConfig) -> ArmSpec | None:
    return next((a for a in cfg.arms if a.is_dense and a.ffn == "preset"), None)


def _plain(arm: ArmSpec) -> bool:
    return arm.type_schedule == "auto" and not arm.structured_scores and arm.init == "dense"


def comparisons(cfg: StudyConfig) -> list[tuple[str, str, str]]:
    """``(question, arm a, arm b)`` pairs the report answers, from the arms' roles."""
    pairs: list[tuple[str, str, str]] = []
    ref = _reference(cfg)
    algebra = [a for a in cfg.arms if not a.is_dense]
    for a in algebra:
        if ref is not None and a.ffn == "preset" and _plain(a):
            pairs.append(("equal parameters", a.name, ref.name))
        if ref is not None and a.ffn == "dense-macs" and _plain(a):
            pairs.append(("equal FFN MACs, more parameters", a.name, ref.name))
        if _plain(a) and a.ffn == "preset":
            for d in cfg.arms:
                if d.is_dense and d.ffn == f"mac-match:{a.algebra}":
                    pairs.append(("equal FFN MACs", a.name, d.name))
    plain = [a for a in algebra if _plain(a) and a.ffn == "preset"]
    for i, a in enumerate(plain):
        for b in plain[i + 1:]:
            pairs.append(("algebra vs algebra (equal parameters)", a.name, b.name))
    for a in algebra:
        for b in algebra:
            if a is b or a.algebra != b.algebra or a.ffn != b.ffn:
                continue
            if (b.type_schedule == "auto" and a.type_schedule != "auto"
                    and a.structured_scores == b.structured_scores and a.init == b.init):
                pairs.append(("type schedule", a.name, b.name))
            if (a.structured_scores and not b.structured_scores
                    and a.type_schedule == b.type_schedule and a.init == b.init):
                pairs.append(("structured attention scores", a.name, b.name))
            if (a.init != "dense" and b.init == "dense" and a.type_schedule == b.type_schedule
                    and a.structured_scores == b.structured_scores):
                pairs.append(("initialisation", a.name, b.name))
    return pairs


def _verdict(a: dict[str, Any], b: dict[str, Any], na: str, nb: str) -> str:
    if a["n"] < a["planned"] or b["n"] < b["planned"]:
        return (f"pending: {a['n']}/{a['planned']} and {b['n']}/{b['planned']} seeds done "
                "(no verdict before every planned seed)")
    if a["n"] == 1 and b["n"] == 1:
        lower = na if a["mean"] < b["mean"] else nb
        return f"one seed each: no interval, no verdict ({lower} lower)"
    if a["max"] < b["min"]:
        return f"**{na} lower** (ranges do not overlap)"
    if b["max"] < a["min"]:
        return f"**{nb} lower** (ranges do not overlap)"
    return "ranges overlap: no difference shown"


def iso_quality(stats: dict[str, dict[str, Any]]) -> tuple[list[tuple[float, float]],
                                                           list[dict[str, Any]]]:
    """Dense arms' (projection MACs, mean loss) curve and, for every algebra arm, the
    dense projection MACs per token that reach its loss (piecewise linear in
    ``log MACs``; ``None`` outside the dense arms' loss range, where ``bound`` says which
    side: ``"below"`` — the arm's loss is above every dense arm's, so even the narrowest
    dense arm (``bound_macs``) reaches it, and fewer MACs than that would do; ``"above"`` —
    it is lower than every dense arm's, so more than the widest one's MACs are needed)."""
    dense = sorted((s["projection_macs"], s["mean"]) for s in stats.values()
                   if s["arm"].is_dense)
    rows = []
    for name, s in stats.items():
        if s["arm"].is_dense:
            continue
        need = None
        bound, bound_macs = None, None
        if dense and s["mean"] > max(v for _, v in dense):
            bound, bound_macs = "below", min(m for m, _ in dense)
        elif dense and s["mean"] < min(v for _, v in dense):
            bound, bound_macs = "above", max(m for m, _ in dense)
        for (m0, l0), (m1, l1) in itertools.pairwise(dense):
            lo, hi = min(l0, l1), max(l0, l1)
            if lo <= s["mean"] <= hi and l0 != l1:
                f = (s["mean"] - l0) / (l1 - l0)
                need = math.exp(math.log(m0) + f * (math.log(m1) - math.log(m0)))
                break
        rows.append({"arm": name, "loss": s["mean"], "macs": s["projection_macs"],
                     "dense_macs_at_loss": need,
                     "ratio": None if need is None else s["projection_macs"] / need,
                     "bound": bound, "bound_macs": bound_macs})
    return dense, rows


def _median_step_seconds(cfg: StudyConfig, run: Run) -> float:
    """Median wall time of one training step of a run, from its ``metrics.csv`` (robust to
    a run that was paused or resumed: the mean would count the gap)."""
    path = Path(cfg.run_config_of(run).out_dir) / "metrics.csv"
    with path.open(newline="") as fh:
        secs = [float(r["seconds"]) for r in csv.DictReader(fh)]
    deltas = [b - a for a, b in itertools.pairwise(secs) if b >= a]
    return statistics.median(deltas) if deltas else (secs[0] if secs else float("nan"))


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "—" if x is None else format(x, spec)


def _plot_curves(cfg: StudyConfig, stats: dict[str, dict[str, Any]], png: Path) -> None:
    from structlm.plotting import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, (name, s) in enumerate(stats.items()):
        curves: dict[int, list[float]] = {}
        for r in s["runs"]:
            path = Path(cfg.run_config_of(r["_run"]).out_dir) / "metrics.csv"
            with path.open(newline="") as fh:
                for row in csv.DictReader(fh):
                    if row["val_loss"]:
                        curves.setdefault(int(row["tokens"]), []).append(float(row["val_loss"]))
        xs = sorted(curves)
        mean = [statistics.fmean(curves[x]) for x in xs]
        style = "--" if s["arm"].is_dense else "-"
        ax.plot(xs, mean, style, marker="o", ms=3, color=f"C{i}",
                label=f"{name} ({s['n']} seed{'s' if s['n'] > 1 else ''})")
        if s["n"] > 1:
            ax.fill_between(xs, [min(curves[x]) for x in xs], [max(curves[x]) for x in xs],
                            color=f"C{i}", alpha=0.15)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (nats/token, sampled windows)")
    ax.set_ylim(top=min(ax.get_ylim()[1], 7.5))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, png)


def _plot_macs(stats: dict[str, dict[str, Any]], png: Path) -> None:
    from structlm.plotting import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    dense = sorted((s["projection_macs"], s["mean"]) for s in stats.values() if s["arm"].is_dense)
    if len(dense) > 1:
        ax.plot(*zip(*dense, strict=True), "--", color="grey", lw=1, label="dense widths")
    for i, (name, s) in enumerate(stats.items()):
        ax.errorbar(s["projection_macs"], s["mean"], yerr=s["std"] or None, fmt="s" if
                    s["arm"].is_dense else "o", color=f"C{i}", capsize=3, label=name)
    ax.set_xlabel("projection MACs per token (attention projections + FFN, forward)")
    ax.set_ylabel("validation loss (whole split, mean ± std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, png)


def _save(fig: Any, png: Path) -> None:
    fig.tight_layout()
    save_figure(fig, png, dpi=120)


def _write_csvs(cfg: StudyConfig, out: Path, per_budget: dict[int, dict[str, dict[str, Any]]]
                ) -> None:
    """``runs.csv`` (one row per run; ``train_seconds`` / ``train_tokens_per_s`` are
    wall-clock, pauses included; the ``median_step`` columns are not) and ``arms.csv``
    (one row per arm and budget)."""
    from structlm.bench.timing import environment, write_csv_atomic

    env = {f"env_{k}": v for k, v in environment().items()}
    runs, arms = [], []
    for stats in per_budget.values():
        for s in stats.values():
            for r in s["runs"]:
                step = _median_step_seconds(cfg, r["_run"])
                steps = cfg.run_config_of(r["_run"]).max_steps
                parts = {f"val_loss_{k}": v["loss"] for k, v in (r.get("val_parts") or {}).items()}
                runs.append({k: v for k, v in r.items()
                             if k not in ("type_tokens_per_window", "_run", "val_parts")}
                            | parts
                            | {"type_tokens_per_window": "/".join(
                                map(str, r["type_tokens_per_window"])),
                               "median_step_seconds": round(step, 3),
                               "median_step_tokens_per_s": round(
                                   r["train_tokens"] / steps / step, 1)} | env)
        arms += [{"arm": n, "steps": s["steps"], "lr": s["lr"], "algebra": s["arm"].algebra,
                  "ffn_width": s["runs"][0]["ffn_width"], "init": s["arm"].init,
                  "type_schedule": s["runs"][0]["type_schedule"],
                  "structured_scores": s["arm"].structured_scores, "seeds": s["n"],
                  "val_loss_mean": s["mean"], "val_loss_std": s["std"],
                  "val_loss_min": s["min"], "val_loss_max": s["max"],
                  "parameters": s["parameters"],
                  "projection_macs_per_token": s["projection_macs"]} | env
                 for n, s in stats.items()]
    write_csv_atomic(str(out / "runs.csv"), runs)
    write_csv_atomic(str(out / "arms.csv"), arms)


def _budget_lines(cfg: StudyConfig, stats: dict[str, dict[str, Any]], unigram: float
                  ) -> list[str]:
    """The arms table, the comparisons and the iso-quality view of one budget."""
    lines = ["| arm | algebra | FFN width | init | schedule | scores | parameters | "
             "projection MACs / token | lr | seeds | validation loss mean ± std | range | "
             "below unigram | train tokens/s (median step) | train min (median step × steps) |",
             "|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for name, s in stats.items():
        r0 = s["runs"][0]
        step_s = [_median_step_seconds(cfg, r["_run"]) for r in s["runs"]]
        tokens_per_step = r0["train_tokens"] / s["steps"]
        speed = statistics.fmean(tokens_per_step / t for t in step_s)
        minutes = statistics.fmean(step_s) * s["steps"] / 60
        lines.append(
            f"| {name} | {s['arm'].algebra} | {r0['ffn_width']} | "
            f"{s['arm'].init if not s['arm'].is_dense else '—'} | "
            f"{r0['type_schedule'] if not s['arm'].is_dense else '—'} | "
            f"{'structured' if s['arm'].structured_scores else 'dense'} | "
            f"{s['parameters']:,} | {s['projection_macs']:,} | {s['lr']:g} | "
            f"{s['n']}/{s['planned']} | "
            f"{s['mean']:.4f} ± {s['std']:.4f} | {s['min']:.4f}–{s['max']:.4f} | "
            f"{unigram - s['mean']:.2f} | {speed:,.0f} | {minutes:.1f} |")
    lines += ["", "| question | arm a | arm b | a − b (means) | verdict |",
              "|---|---|---|---:|---|"]
    for question, a, b in comparisons(cfg):
        if a in stats and b in stats:
            sa, sb = stats[a], stats[b]
            note = ("" if (sa["n"] > 1 and sb["n"] > 1) or (sa["n"] == sb["n"] == 1)
                    or sa["n"] < sa["planned"] or sb["n"] < sb["planned"]
                    else " (against a one-seed arm: its range is one value)")
            lines.append(f"| {question} | {a} | {b} | {sa['mean'] - sb['mean']:+.4f} | "
                         f"{_verdict(sa, sb, a, b)}{note} |")
        else:
            lines.append(f"| {question} | {a} | {b} | — | not run at this budget (yet) |")
    dense, iso = iso_quality(stats)
    lines += ["", "Iso-quality: dense projection MACs needed for each arm's loss.", "",
              "| arm | loss | its MACs / token | dense MACs / token at that loss | ratio |",
              "|---|---:|---:|---:|---:|"]
    for r in iso:
        need, ratio = _fmt(r["dense_macs_at_loss"], ",.0f"), _fmt(r["ratio"], ".3f")
        if r["bound"] is not None:
            sign = "<" if r["bound"] == "below" else ">"
            need = f"{sign} {r['bound_macs']:,.0f}"
            ratio = f"{'>' if sign == '<' else '<'} {r['macs'] / r['bound_macs']:.3f}"
        lines.append(f"| {r['arm']} | {r['loss']:.4f} | {r['macs']:,} | {need} | {ratio} |")
    lines += ["", f"Dense points: {', '.join(f'{m:,} MACs → {v:.4f}' for m, v in dense)}."]
    return lines


_ISO_TEXT = ("Iso-quality: dense arms (FFN widths) give a curve of loss against projection MACs "
             "per token (attention projections + FFN, forward; the LM head is the same for "
             "all); each algebra arm's mean loss is placed on it by interpolation in log MACs. "
             "A ratio below 1 means the arm reaches that loss with fewer MACs than a dense FFN "
             "would need. Outside the dense arms' loss range there is no extrapolation, only a "
             "bound: '< X' means even the narrowest dense arm (X MACs) reaches a lower loss, "
             "so a dense FFN needs fewer MACs than X (ratio '> r'); '> X' means the arm is "
             "lower than the widest dense arm.")


def write_report(cfg: StudyConfig, data: Any) -> Path:
    """Write ``report.md``, ``runs.csv``, ``arms.csv``, ``curves.png`` (the largest budget
    with runs), ``loss_vs_macs.png`` and, with several budgets, ``loss_vs_tokens.png``
    from the finished runs; returns the report's path."""
    from structlm.experiments.study import report_tokens
    from structlm.train.evaluate import unigram_loss

    out = Path(cfg.out_dir)
    per_budget = {b: st for b in cfg.all_budgets() if (st := arm_stats(cfg, b))}
    sweep = report_tokens.sweep_table(cfg)
    if not per_budget and not sweep:
        raise ValueError("no finished run to report")
    unigram = unigram_loss(data.tokens("train"), data.tokens("val"), data.vocab_size)
    rc = cfg.run_config(cfg.arms[0], cfg.arms[0].seeds[0], lr=1.0)
    tokens_per_step = rc.batch_size * rc.seq_len * rc.grad_accum
    val_tokens = int(data.meta["val_tokens"])
    budgets = ", ".join(f"{b} steps = {b * tokens_per_step:,} tokens"
                        for b in cfg.all_budgets())
    lr_text = ("each arm's rate in its table row (a fixed rate, or the best of the sweep "
               "below)" if not cfg.legacy_layout else f"lr {rc.lr}")
    lines = [f"# structlm experiment study: `{cfg.preset}` on `{cfg.corpus}`", "",
             f"Budgets: {budgets} ({rc.batch_size} × {rc.seq_len} tokens per step); every run "
             f"trains from scratch at its budget: AdamW, {lr_text}, {rc.warmup_steps} warm-up "
             f"steps and cosine decay to {rc.min_lr_ratio} of the rate, weight decay "
             f"{rc.weight_decay}; tokenizer `{cfg.tokenizer}` ({data.vocab_size:,} tokens, "
             "trained on the training documents only). Validation: the whole held-out split, "
             f"{val_tokens:,} tokens of {len(data.meta['val_documents'])} "
             f"documents ({', '.join(data.meta['val_documents'])}), float64 sums"
             + (", scored per corpus part (no window spans two parts) and pooled "
                "token-weighted" if len(data.val_parts()) > 1 else "")
             + f". Unigram loss of the validation text under the training frequencies: "
             f"{unigram:.4f} nats/token.", "",
             "Verdict rule (set before the runs): two arms differ only when their seed ranges "
             "[min, max] do not overlap.", "",
             "Training speed columns: the median step of each run as it ran (mean over the "
             "arm's seeds). Runs may have had different thread counts and other jobs beside "
             "them (a resumable study runs across sessions), so these columns state what a "
             "run cost, not which layer is faster: the generation benchmark below times both "
             "models interleaved in one process.", ""]
    lines += report_tokens.sweep_lines(cfg, sweep)
    for steps, stats in per_budget.items():
        params = next(iter(stats.values()))["parameters"]
        lines += [f"## {steps} steps: {steps * tokens_per_step:,} training tokens "
                  f"({steps * tokens_per_step / params:.2f} per parameter of a "
                  f"{params:,}-parameter arm)", ""]
        lines += [*_budget_lines(cfg, stats, unigram), ""]
        lines += report_tokens.part_lines(stats)
    lines += ["", _ISO_TEXT]
    lines += report_tokens.trend_lines(cfg, per_budget, comparisons(cfg))
    gen = out / "generate.md"
    if gen.exists():
        lines += ["", "## Generation throughput (fixed length, batch 1, trained models)", "",
                  gen.read_text().split("\n", 2)[2]]
    if per_budget:
        last = per_budget[max(per_budget)]
        _plot_curves(cfg, last, out / "curves.png")
        _plot_macs(last, out / "loss_vs_macs.png")
        _write_csvs(cfg, out, per_budget)
        lines += ["", f"![validation curves, {max(per_budget)} steps](curves.png)", "",
                  f"![loss vs MACs, {max(per_budget)} steps](loss_vs_macs.png)", ""]
        if len(cfg.all_budgets()) > 1:
            report_tokens.plot_loss_vs_tokens(per_budget, tokens_per_step,
                                              out / "loss_vs_tokens.png")
            lines += ["![loss vs training tokens](loss_vs_tokens.png)", ""]
    report = out / "report.md"
    atomic_write_text(report, "\n".join(lines))
    return report
