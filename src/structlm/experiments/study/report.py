"""The study's report: per budget, per-arm results with seeds, the pre-set comparisons
(equal parameters, equal FFN MACs, wide at equal MACs, Q4 vs Q2^2, schedules, structured
scores, initialisation) with their verdicts, the ranking, the iso-quality view and per-part
scores; the learning-rate sweep and the gaps across budgets (:mod:`.report_tokens`);
generation throughput, CSVs and plots.

Verdicts (set before the runs, the same for every comparison): each (arm, budget) is a
:class:`structlm.stats.Arm` of its seeds' per-window **test** scores (pooled over the corpus
parts; budget ``{"steps": N, "tokens": N · batch · seq_len}``) and two arms are compared
by :func:`structlm.stats.compare`: the difference in mean test NLL per token ``a − b``
with its 95% interval (hierarchical bootstrap over seeds, then windows, paired by window;
Student-t quantile). A difference is declared ("… lower") only when the interval excludes
zero, else "no difference shown" with the smallest difference the comparison would have
detected; no verdict before every planned seed has finished, none between different
budgets (:class:`~structlm.stats.UnequalBudgetError`). The arms of a budget are also ranked
(:func:`structlm.stats.rank_arms`: a winner only if it is lower than each other arm).
The tables' means, iso-quality and per-part numbers describe; only the verdict columns
decide.
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
    PROTOCOL,
    ArmSpec,
    OldProtocolError,
    Run,
    StudyConfig,
    chosen_rates,
    run_summary,
)
from structlm.plotting import save_figure
from structlm.stats import Arm, Comparison, WindowScores, compare, rank_arms

__all__ = [
    "arm_of_runs",
    "arm_stats",
    "comparison_cells",
    "comparisons",
    "iso_quality",
    "pair_comparison",
    "write_report",
]


def arm_of_runs(name: str, runs: list[dict[str, Any]]) -> Arm:
    """The :class:`~structlm.stats.Arm` of finished runs (their ``final.json``): each run's
    pooled test scores, the budget they share (``{"steps", "tokens"}``)."""
    budgets = {(r["budget"]["steps"], r["budget"]["tokens"]) for r in runs}
    if len(budgets) != 1:
        raise ValueError(f"arm {name!r}: its runs have different budgets {sorted(budgets)}")
    steps, tokens = budgets.pop()
    return Arm(name, tuple(WindowScores.from_dict(r["test"]["pooled"]) for r in runs),
               budget={"steps": steps, "tokens": tokens})


def arm_stats(cfg: StudyConfig, steps: int | None = None) -> dict[str, dict[str, Any]]:
    """Per arm with at least one finished, test-scored run at the budget of ``steps``
    training steps (default: the first budget), at the arm's rate: the runs, their test
    :class:`~structlm.stats.Arm` and descriptive statistics of the runs' mean test NLL."""
    steps = cfg.all_budgets()[0] if steps is None else steps
    main = [r for r in cfg.main_runs(chosen_rates(cfg)) if r.steps == steps]
    out = {}
    for arm in cfg.arms:
        mine: list[Run] = [r for r in main if r.arm.name == arm.name]
        runs = []
        for r in mine:
            s = run_summary(cfg, r)
            if s is None:
                continue
            if s.get("protocol", 1) != PROTOCOL:
                raise OldProtocolError(f"{cfg.run_config_of(r).out_dir}/final.json was "
                                       f"written under study protocol {s.get('protocol', 1)}"
                                       f": no test scores, no protocol-{PROTOCOL} verdict")
            if "test" in s:  # a run stopped before its test scores is not finished
                runs.append({**s, "_run": r})
        if not runs:
            continue
        nll = [r["test"]["mean_nll"] for r in runs]
        scores = arm_of_runs(arm.name, runs)
        out[arm.name] = {
            "arm": arm, "runs": runs, "n": len(runs), "planned": len(arm.seeds), "steps": steps,
            "lr": mine[0].lr, "scores": scores, "seeds": [r["seed"] for r in runs],
            "mean": scores.mean_nll,
            "std": statistics.stdev(nll) if len(nll) > 1 else 0.0,
            "min": min(nll), "max": max(nll),
            "val_mean": statistics.fmean(r["val_loss"] for r in runs),
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


def complete(s: dict[str, Any]) -> bool:
    """Every planned seed of the arm has finished (and been scored on test)."""
    return s["n"] >= s["planned"]


def pair_comparison(sa: dict[str, Any], sb: dict[str, Any], seed: int = 0
                    ) -> Comparison | str:
    """:func:`structlm.stats.compare` of two arms of one budget (:func:`arm_stats`
    entries), or why there is no verdict yet (``pending: …``)."""
    if not complete(sa) or not complete(sb):
        return (f"pending: {sa['n']}/{sa['planned']} and {sb['n']}/{sb['planned']} seeds "
                "done (no verdict before every planned seed)")
    return compare(sa["scores"], sb["scores"], seed=seed)


def comparison_cells(c: Comparison | str) -> list[str]:
    """Table cells: ``a − b`` test NLL with its 95% interval, the perplexity ratio, the
    verdict, the detectable difference."""
    if isinstance(c, str):
        return ["—", "—", c, "—"]
    r, rlo, rhi = c.ratio
    if c.decided:
        verdict = f"**{c.lower} lower**"
    elif c.verdict == "no difference shown":
        verdict = "no difference shown"
    else:
        verdict = c.verdict
    detectable = "—" if math.isnan(c.detectable) else f"{c.detectable:.4f}"
    return [f"{c.diff:+.4f} [{c.lo:+.4f}, {c.hi:+.4f}]", f"×{r:.3f} [{rlo:.3f}–{rhi:.3f}]",
            verdict, detectable]


def iso_quality(stats: dict[str, dict[str, Any]]) -> tuple[list[tuple[float, float]],
                                                           list[dict[str, Any]]]:
    """Dense arms' (projection MACs, mean test NLL) curve and, for every algebra arm, the
    dense projection MACs per token that reach its mean (descriptive: no interval;
    piecewise linear in ``log MACs``; ``None`` outside the dense arms' range, where
    ``bound`` says which side: ``"below"`` — the arm's NLL is above every dense arm's, so
    even the narrowest dense arm (``bound_macs``) reaches it, and fewer MACs than that
    would do; ``"above"`` — it is lower than every dense arm's, so more than the widest
    one's MACs are needed)."""
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
    ax.set_ylabel("test NLL (nats/token, mean ± std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, png)


def _save(fig: Any, png: Path) -> None:
    fig.tight_layout()
    save_figure(fig, png, dpi=120)


def _write_csvs(cfg: StudyConfig, out: Path, per_budget: dict[int, dict[str, dict[str, Any]]]
                ) -> None:
    """``runs.csv`` (one row per run: its test NLL, pooled and per part, and validation
    loss; ``train_seconds`` / ``train_tokens_per_s`` are wall-clock, pauses included; the
    ``median_step`` columns are not) and ``arms.csv`` (one row per arm and budget)."""
    from structlm.bench.timing import environment, write_csv_atomic

    env = {f"env_{k}": v for k, v in environment().items()}
    skip = ("type_tokens_per_window", "_run", "val_parts", "validation", "test", "budget")
    runs, arms = [], []
    for stats in per_budget.values():
        for s in stats.values():
            for r in s["runs"]:
                step = _median_step_seconds(cfg, r["_run"])
                steps = cfg.run_config_of(r["_run"]).max_steps
                parts = {f"val_loss_{k}": v["loss"] for k, v in (r.get("val_parts") or {}).items()}
                test = {"test_nll": r["test"]["mean_nll"], "test_tokens": r["test"]["tokens"],
                        "test_windows": len(r["test"]["pooled"]["window_nll"])}
                if len(r["test"]["parts"]) > 1:
                    test |= {f"test_nll_{k}": v["mean_nll"]
                             for k, v in r["test"]["parts"].items()}
                runs.append({k: v for k, v in r.items() if k not in skip}
                            | test | parts
                            | {"type_tokens_per_window": "/".join(
                                map(str, r["type_tokens_per_window"])),
                               "median_step_seconds": round(step, 3),
                               "median_step_tokens_per_s": round(
                                   r["train_tokens"] / steps / step, 1)} | env)
        arms += [{"arm": n, "steps": s["steps"], "lr": s["lr"], "algebra": s["arm"].algebra,
                  "ffn_width": s["runs"][0]["ffn_width"], "init": s["arm"].init,
                  "type_schedule": s["runs"][0]["type_schedule"],
                  "structured_scores": s["arm"].structured_scores, "seeds": s["n"],
                  "test_nll_mean": s["mean"], "test_nll_std": s["std"],
                  "test_nll_min": s["min"], "test_nll_max": s["max"],
                  "val_loss_mean": s["val_mean"],
                  "parameters": s["parameters"],
                  "projection_macs_per_token": s["projection_macs"]} | env
                 for n, s in stats.items()]
    write_csv_atomic(str(out / "runs.csv"), runs)
    write_csv_atomic(str(out / "arms.csv"), arms)


def _budget_lines(cfg: StudyConfig, stats: dict[str, dict[str, Any]], unigram: float
                  ) -> list[str]:
    """The arms table, the comparisons with their verdicts, the ranking and the
    iso-quality view of one budget."""
    lines = ["| arm | algebra | FFN width | init | schedule | scores | parameters | "
             "projection MACs / token | lr | seeds | test NLL (arm mean) | seed range | "
             "below unigram | validation loss (mean) | train tokens/s (median step) | "
             "train min (median step × steps) |",
             "|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
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
            f"{s['mean']:.4f} | {s['min']:.4f}–{s['max']:.4f} | "
            f"{unigram - s['mean']:.2f} | {s['val_mean']:.4f} | {speed:,.0f} | {minutes:.1f} |")
    lines += ["", "| question | arm a | arm b | a − b, test NLL [95% interval] | "
              "perplexity a / b | verdict | detectable difference |",
              "|---|---|---|---:|---:|---|---:|"]
    for i, (question, a, b) in enumerate(comparisons(cfg)):
        if a in stats and b in stats:
            cells = comparison_cells(pair_comparison(stats[a], stats[b], seed=i))
            lines.append(f"| {question} | {a} | {b} | {' | '.join(cells)} |")
        else:
            lines.append(f"| {question} | {a} | {b} | — | — | not run at this budget (yet) "
                         "| — |")
    done = [s["scores"] for s in stats.values() if complete(s)]
    if len(done) > 1:
        ranking = rank_arms(done)
        lines += ["", f"Ranking of the {len(done)} arms with every seed (each pair compared "
                  f"as above): {ranking.text()}."]
    dense, iso = iso_quality(stats)
    lines += ["", "Iso-quality: dense projection MACs needed for each arm's mean test NLL "
              "(descriptive).", "",
              "| arm | test NLL | its MACs / token | dense MACs / token at that NLL | ratio |",
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


_ISO_TEXT = ("Iso-quality: dense arms (FFN widths) give a curve of test NLL against projection "
             "MACs per token (attention projections + FFN, forward; the LM head is the same for "
             "all); each algebra arm's mean is placed on it by interpolation in log MACs. "
             "A ratio below 1 means the arm reaches that loss with fewer MACs than a dense FFN "
             "would need. Outside the dense arms' loss range there is no extrapolation, only a "
             "bound: '< X' means even the narrowest dense arm (X MACs) reaches a lower loss, "
             "so a dense FFN needs fewer MACs than X (ratio '> r'); '> X' means the arm is "
             "lower than the widest dense arm.")


def _documents(names: list[str]) -> str:
    return f"{len(names)} documents ({', '.join(names)})"


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
    unigram = unigram_loss(data.tokens("train"), data.tokens("test"), data.vocab_size)
    rc = cfg.run_config(cfg.arms[0], cfg.arms[0].seeds[0], lr=1.0)
    tokens_per_step = rc.batch_size * rc.seq_len * rc.grad_accum
    meta = data.meta
    budgets = ", ".join(f"{b} steps = {b * tokens_per_step:,} tokens"
                        for b in cfg.all_budgets())
    lr_text = ("each arm's rate in its table row (a fixed rate, or the best of the sweep "
               "below)" if not cfg.legacy_layout else f"lr {rc.lr}")
    per_part = len(data.test_parts()) > 1
    lines = [f"# structlm experiment study: `{cfg.preset}` on `{cfg.corpus}`", "",
             f"Budgets: {budgets} ({rc.batch_size} × {rc.seq_len} tokens per step); every run "
             f"trains from scratch at its budget: AdamW, {lr_text}, {rc.warmup_steps} warm-up "
             f"steps and cosine decay to {rc.min_lr_ratio} of the rate, weight decay "
             f"{rc.weight_decay}; tokenizer `{cfg.tokenizer}` ({data.vocab_size:,} tokens, "
             "trained on the training documents only).", "",
             f"Text, split by whole documents{' (each corpus on its own)' if per_part else ''}"
             f": training {len(meta['train_documents'])} documents, "
             f"{int(meta['train_tokens']):,} tokens; validation {int(meta['val_tokens']):,} "
             f"tokens of {_documents(meta['val_documents'])}; test "
             f"{int(meta['test_tokens']):,} tokens of {_documents(meta['test_documents'])}. "
             "Every decision (the learning-rate sweep's choice, the curves) reads validation "
             "only; each run that enters the verdicts is scored once on the test text, at "
             f"the end: per-window NLL sums over windows of {rc.seq_len} tokens, float64"
             + (", per corpus part (no window spans two parts) and pooled" if per_part else "")
             + ". Unigram NLL of the test text under the training frequencies: "
             f"{unigram:.4f} nats/token.", "",
             "Verdict rule (set before the runs): a − b is the difference in mean test NLL "
             "per token, with its 95% interval from a hierarchical bootstrap over seeds, "
             "then windows, paired by window (structlm.stats.compare; Student-t quantile). "
             "A difference is declared only when the interval excludes zero; otherwise "
             "\"no difference shown\", with the smallest difference the comparison would "
             "have detected (80% power). No verdict before every planned seed, none "
             "between different budgets.", "",
             "Training speed columns: the median step of each run as it ran (mean over the "
             "arm's seeds). Runs may have had different thread counts and other jobs beside "
             "them (a resumable study runs across sessions), so these columns state what a "
             "run cost, not which layer is faster: the generation benchmark below times both "
             "models interleaved in one process.", ""]
    if cfg.notes:
        lines += ["## Scope", "", *[f"- {n}" for n in cfg.notes], ""]
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
                  f"![test NLL vs MACs, {max(per_budget)} steps](loss_vs_macs.png)", ""]
        if len(cfg.all_budgets()) > 1:
            report_tokens.plot_loss_vs_tokens(per_budget, tokens_per_step,
                                              out / "loss_vs_tokens.png")
            lines += ["![test NLL vs training tokens](loss_vs_tokens.png)", ""]
    report = out / "report.md"
    atomic_write_text(report, "\n".join(lines))
    return report
