"""``structlm experiment share``: the seed's tests 4–9 end to end on one model, in two
budget regimes.

Every arm starts from a fresh copy of the same loaded model, uses the same calibration
windows, the same evaluation windows and the same perplexity function; every fine-tuned
arm gets the same fine-tuning config (only its seed differs):

* **whole-model compression** (tests 4–6, the regime of the Basis Sharing and SVD-LLM
  tables): each method removes 20/30/40/50% of *every* decoder linear type's parameters
  (attention and MLP); the arms' stored parameters are asserted equal to the budget
  within ``budget_tolerance``; analytic perplexity, then fine-tuning over seeds;
* **the seed's regime** (tests 4–6 as the seed states them): Q only, the shared method at
  ``k = d/4``, every other method at the storage that leaves (the closest it can reach
  without exceeding it), fine-tuned long enough to plateau;
* **test 7 / 9** — shared and hybrid on attention only, MLP only, all, at one reduction
  per type (so the scopes are compared at equal compression ratios);
* **test 8** is this experiment run on a second model, compared finding by finding with
  ``structlm experiment transfer`` (:mod:`.transfer`).

Fine-tuning's recovery is reported per text: the share of the log-perplexity damage
undone, in-domain and on the other-domain text (fine-tuning on in-domain text can be
domain adaptation rather than repair).

Every decision reads the validation windows (the calibration documents' held-out tails):
the fine-tuning curves, their plateau, the continuation of every whole-model run when one
has not plateaued, the learning-rate probe (``lr_probe_rates``) and the best checkpoint
(``finetune.keep_best``). The test windows are scored once per finished arm, and every
verdict is a paired comparison of their per-window NLLs (:mod:`structlm.stats`).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from structlm.atomic import atomic_write_text, clean_json
from structlm.experiments.finished_runs import merge_finished_runs, read_finished_runs
from structlm.experiments.plot_throttle import PlotThrottle
from structlm.experiments.share.arms import ArmCache, calib_seed, token_macs_ratio
from structlm.experiments.share.beside import load_beside
from structlm.experiments.share.budget import check_budgets_feasible
from structlm.experiments.share.config import (
    ExperimentConfig,
    methods_at,
    probe_reduction,
    whole_finetune,
)
from structlm.experiments.share.rate_probe import choose_rate
from structlm.folders import check_apart, run_folder_lock
from structlm.hf.finetune import FinetuneConfig
from structlm.hf.pipeline import Prepared, evaluate_all, prepare
from structlm.share.compress import CompressionConfig
from structlm.share.compress.io import source_chain
from structlm.share.compress.methods import (
    BASIS_SHARING_METHOD,
    HYBRID_METHOD,
    SHARED_METHOD,
    BasisSharingOptions,
    HybridOptions,
)

__all__ = ["ExperimentConfig", "draw_seeds", "run_experiment"]


def draw_seeds(seeds: list[int], draw: int, all_seeds: list[int]) -> list[int]:
    """The fine-tuning seeds of calibration draw number ``draw`` (0: the first):
    ``seeds`` shifted by ``draw × (max(all_seeds) + 1)``, so every (draw, seed) pair has
    its own batch order and the fine-tuned ranges span both sources of variance."""
    return [s + draw * (max(all_seeds) + 1) for s in seeds]


def _summary(arms: list[dict[str, Any]], key: str, name: str) -> dict[str, float]:
    vals = [a[key][name] for a in arms if key in a]
    if not vals:
        return {}
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1
            else 0.0, "min": min(vals), "max": max(vals), "n": len(vals)}


def _check_budget(arm: dict[str, Any], target: float, tol: float) -> None:
    dev = arm["stored_parameters"] / target - 1
    if not -tol <= dev <= 1e-12:
        raise AssertionError(f"{arm['method']} at {arm['reduction']}: stored "
                             f"{arm['stored_parameters']:,} vs budget {target:,.0f} "
                             f"({dev:+.2%}; allowed −{tol:.1%}..0)")


@dataclass
class _Cell:
    """One compression setting of a section and the seeds it is fine-tuned with."""

    section: str
    ccfg: CompressionConfig
    ft: FinetuneConfig
    seeds: list[int]
    priority: list[int]
    """Per seed: its place in the fine-tuning order (lower first)."""
    prep: Prepared | None = None
    """The calibration draw of a whole-model cell (``None``: the first)."""


def _seed_ccfgs(cfg: ExperimentConfig, prep: Prepared, cache: ArmCache, progress: bool
                ) -> tuple[dict[str, CompressionConfig], dict[str, Any]]:
    """The seed regime's compression per method (``shared`` at ``k = d/4``; every other
    method of ``seed_methods`` and ``seed_control_methods`` at the storage that leaves),
    and the regime's description."""
    if not cfg.seed_regime or not (cfg.seed_methods or cfg.seed_control_methods):
        return {}, {}
    ref = CompressionConfig(method=SHARED_METHOD.name, types=cfg.seed_types,
                            k_fraction=cfg.seed_k_fraction)
    a = cache.analytic(prep, ref, progress)
    budget = 1 - a["stored_parameters"] / a["original_parameters"]
    info = {"k": round(cfg.seed_k_fraction * prep.adapter.hidden_size),
            "types": cfg.seed_types, "reduction_of_shared": budget}
    out = {m: ref if m == SHARED_METHOD.name else CompressionConfig(
        method=m, types=cfg.seed_types, target_reduction=budget,
        basis_sharing=BasisSharingOptions(group_size=cfg.group_size),
        hybrid=HybridOptions(residual_rank=cfg.residual_rank))
        for m in dict.fromkeys([*cfg.seed_methods, *cfg.seed_control_methods])}
    return out, info


def _with_rate(ft: FinetuneConfig, rates: list[float], method: str,
               probed: dict[str, float]) -> FinetuneConfig | None:
    """``ft`` at the probe's rate for ``method`` (``None``: the probe is not done yet;
    ``ft`` itself when there is no probe)."""
    if not rates:
        return ft
    return dataclasses.replace(ft, lr=probed[method]) if method in probed else None


def _cells(cfg: ExperimentConfig, prep: Prepared, cache: ArmCache, progress: bool,
           draws: list[Prepared] | None = None,
           probed: dict[str, dict[str, float]] | None = None
           ) -> tuple[list[_Cell], dict[str, Any]]:
    """Every setting (the analytic phase runs as they are made: the seed regime's other
    methods need the shared arm's storage). A method waiting for its rate probe gets no
    fine-tuning seeds yet."""
    probed = probed or {}
    cells: list[_Cell] = []
    n_s = len(cfg.seeds)
    seed_ccfgs, info = _seed_ccfgs(cfg, prep, cache, progress)
    for section, methods, base, rates in (
            ("seed", cfg.seed_methods, cfg.seed_finetune, cfg.seed_lr_probe_rates),
            ("seed-control", cfg.seed_control_methods, cfg.seed_control_finetune,
             cfg.seed_control_lr_probe_rates)):
        for method in methods if seed_ccfgs else []:
            ft = _with_rate(base, rates, method, probed.get(section, {}))
            cells.append(_Cell(section, seed_ccfgs[method], ft or base,
                               cfg.seeds if ft is not None else [],
                               [10 + 100 * i for i in range(n_s)] if ft is not None else []))
    for j, red in enumerate(cfg.reductions if cfg.whole_model else []):
        multi = red in cfg.multi_seed_reductions
        for d, draw in enumerate([None, *(draws or [])]):
            if d and cfg.draw_reductions is not None and red not in cfg.draw_reductions:
                continue
            for method in methods_at(cfg, red):
                tuned = cfg.finetune_methods is None or method in cfg.finetune_methods
                waiting = bool(cfg.lr_probe_rates) and method not in probed.get("whole", {})
                seeds = draw_seeds((cfg.seeds if multi else cfg.seeds[:1])
                                   if tuned and not waiting else [], d, cfg.seeds)
                first = 0 if multi else 5  # seed 0 of the multi-seed budgets first
                cells.append(_Cell("whole", _whole_ccfg(cfg, method, red),
                                   whole_finetune(cfg, method, probed.get("whole")), seeds,
                                   [first + j + 100 * i + d for i in range(len(seeds))], draw))
    if cfg.scope:
        for method in (SHARED_METHOD.name, HYBRID_METHOD.name):
            for types in ("attn", "mlp", "all"):
                ccfg = CompressionConfig(method=method, types=types,
                                         target_reduction=cfg.scope_reduction,
                                         hybrid=HybridOptions(residual_rank=cfg.residual_rank))
                cells.append(_Cell("scope", ccfg, cfg.finetune, cfg.seeds[:1], [50]))
    for c in cells:
        a = cache.analytic(c.prep or prep, c.ccfg, progress)
        if c.section == "whole":
            _check_budget(a, (1 - c.ccfg.target_reduction) * a["original_parameters"],
                          cfg.budget_tolerance)
    return cells, info


def _whole_ccfg(cfg: ExperimentConfig, method: str, reduction: float) -> CompressionConfig:
    """The compression of a whole-model arm."""
    return CompressionConfig(
        method=method, types=cfg.types, target_reduction=reduction,
        hybrid=HybridOptions(residual_rank=cfg.residual_rank),
        basis_sharing=BasisSharingOptions(
            group_size=cfg.group_size,
            update=cfg.update and method == BASIS_SHARING_METHOD.name))


def _probe_groups(cfg: ExperimentConfig, prep: Prepared, cache: ArmCache, progress: bool
                  ) -> list[tuple[str, dict[str, CompressionConfig], FinetuneConfig,
                                  list[float]]]:
    """The rate probes asked for: (section, method → compression, fine-tuning, rates)."""
    groups = []
    if cfg.lr_probe_rates and cfg.whole_model:
        red = probe_reduction(cfg)
        tuned = [m for m in cfg.methods
                 if cfg.finetune_methods is None or m in cfg.finetune_methods]
        groups.append(("whole", {m: _whole_ccfg(cfg, m, red) for m in tuned}, cfg.finetune,
                       list(cfg.lr_probe_rates)))
    seed_ccfgs, _ = _seed_ccfgs(cfg, prep, cache, progress)
    for section, methods, ft, rates in (
            ("seed", cfg.seed_methods, cfg.seed_finetune, cfg.seed_lr_probe_rates),
            ("seed-control", cfg.seed_control_methods, cfg.seed_control_finetune,
             cfg.seed_control_lr_probe_rates)):
        if rates and seed_ccfgs and methods:
            groups.append((section, {m: seed_ccfgs[m] for m in methods}, ft, list(rates)))
    return groups


def _probe(cfg: ExperimentConfig, prep: Prepared, cache: ArmCache, progress: bool,
           run: bool) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """The learning-rate probes (whole model, seed regime, seed control): per method, its
    runs at every rate (run now when ``run``) and the rate chosen on the validation text;
    returns per section the chosen rates of the methods whose probe is complete, and the
    probes' record."""
    chosen: dict[str, dict[str, float]] = {}
    record: dict[str, Any] = {}
    for section, ccfgs, ft, rates in _probe_groups(cfg, prep, cache, progress):
        where = (f"−{probe_reduction(cfg):.0%} of every {cfg.types} type" if section == "whole"
                 else f"the seed regime ({cfg.seed_types} at the shared basis's storage)")
        rec: dict[str, Any] = {"steps": cfg.lr_probe_steps, "rates": rates,
                               "seed": cfg.seeds[0], "methods": {}, "setting": where,
                               "lr_scaling": ft.lr_scaling}
        for method, ccfg in ccfgs.items():
            curves = {}
            for rate in rates:
                arm = cache.probe(prep, ccfg, ft, rate, cfg.lr_probe_steps, cfg.seeds[0],
                                  progress, run)
                if arm is not None:
                    curves[rate] = arm["curve"]
            if len(curves) == len(rates):
                choice = choose_rate(curves)
                chosen.setdefault(section, {})[method] = choice["rate"]
                rec["methods"][method] = {**choice, "curves": {
                    str(r): [(c["step"], c["val_ppl"]) for c in cv if c.get("val_ppl")]
                    for r, cv in curves.items()}}
            else:
                rec["methods"][method] = {"done": len(curves), "planned": len(rates)}
        record[section] = rec
    return chosen, record


def _whole_runs(cfg: ExperimentConfig, prep: Prepared, cells: list[_Cell]
                ) -> list[tuple[_Cell, int, Prepared]]:
    """Every planned whole-model fine-tuning run: (cell, seed, its draw)."""
    return [(c, s, c.prep or prep) for c in cells if c.section == "whole" and c.ft.steps > 0
            for s in c.seeds]


def continue_whole(cfg: ExperimentConfig, prep: Prepared, cache: ArmCache,
                   cells: list[_Cell]) -> bool | None:
    """Whether every whole-model run is continued to ``continue_unplateaued_to``: when any
    of them has not plateaued on its validation curve (equal budgets for every compared
    pair); ``None`` until every planned run is done."""
    from structlm.experiments.share.report import run_plateaued

    if cfg.continue_unplateaued_to is None:
        return False
    runs = []
    for c, s, p in _whole_runs(cfg, prep, cells):
        if not cache.has_tuned(p, c.ccfg, c.ft, s):
            return None
        runs.append(cache.done[cache.tuned_key(p, c.ccfg, c.ft, s)])
    return any(run_plateaued(r, cfg.plateau_window) is False for r in runs)


def _assemble(cfg: ExperimentConfig, prep: Prepared, cache: ArmCache, cells: list[_Cell],
              info: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    """Sections of the results from whatever the cache holds now."""
    out: dict[str, Any] = {"whole_model": [], "scope": []}
    seed_entries, control_entries = [], []
    whole: dict[tuple[str, float | None], dict[str, Any]] = {}
    cont = continue_whole(cfg, prep, cache, cells)
    for c in cells:
        p = c.prep or prep
        a = cache.analytic(p, c.ccfg, False)
        a = {**a, "token_macs_ratio": token_macs_ratio(p, c.ccfg, a),
             "calib_seed": calib_seed(p)}
        arms = []
        for s in c.seeds:
            if not cache.has_tuned(p, c.ccfg, c.ft, s):
                continue
            longer = None
            if c.section == "whole" and cont and cfg.continue_unplateaued_to:
                longer = cache.continued(p, c.ccfg, c.ft, s, cfg.continue_unplateaued_to,
                                         False, run=False)
                if longer is not None:
                    out.setdefault("continued", []).append(
                        {"method": c.ccfg.method, "reduction": c.ccfg.target_reduction,
                         "seed": s, "calib_seed": calib_seed(p), "from_steps": c.ft.steps,
                         "to_steps": cfg.continue_unplateaued_to})
            arms.append({**a, **(longer or cache.tuned(p, c.ccfg, c.ft, s, False))})
        if c.section == "whole" and c.prep is not None:  # another draw of an entry
            e = whole[(c.ccfg.method, c.ccfg.target_reduction)]
            e["analytic_by_draw"][str(calib_seed(p))] = a["ppl_analytic"]
            e["analytic_arms"].append(a)
            e["seeds_planned"] += [f"{s} (draw {calib_seed(p)})" for s in c.seeds]
            if arms:
                e["arms"] = [x for x in e["arms"] if "ppl_finetuned" in x] + arms
                tuned = [x for x in e["arms"] if "ppl_finetuned" in x]
                e["finetuned"] = {t: _summary(tuned, "ppl_finetuned", t) for t in texts}
            continue
        entry = {"method": c.ccfg.method, "reduction": c.ccfg.target_reduction,
                 "arms": arms or [a], "analytic": a["ppl_analytic"], "analytic_arms": [a],
                 "finetuned": {t: _summary(arms, "ppl_finetuned", t) for t in texts},
                 "seeds_planned": list(c.seeds), "lr": c.ft.lr}
        if c.section == "whole":
            entry["analytic_by_draw"] = {str(calib_seed(p)): a["ppl_analytic"]}
            whole[(c.ccfg.method, c.ccfg.target_reduction)] = entry
            out["whole_model"].append(entry)
        elif c.section == "seed":
            seed_entries.append(entry)
        elif c.section == "seed-control":
            control_entries.append(entry)
        else:
            out["scope"].append(entry["arms"][0])
    if seed_entries:
        out["seed_regime"] = {**info, "entries": seed_entries}
    if control_entries:
        out["seed_control"] = {**info, "entries": control_entries}
    out["continue_whole"] = cont
    return out


def run_experiment(cfg: ExperimentConfig, out_dir: str | Path, progress: bool = True,
                   analytic_only: bool = False,
                   add_runs: list[str | Path] | tuple[str | Path, ...] = (),
                   probe_only: bool = False) -> dict[str, Any]:
    """Run the regimes: first every arm's compression and analytic evaluation, then the
    learning-rate probe (if asked), then the fine-tuning runs in priority order (seed 0 of
    every whole-model budget first), the report rewritten after each; ``analytic_only``
    stops after the first phase. Writes ``experiment.json``, ``report.md`` and plots.
    ``add_runs``: other folders of the same experiment (parts of the plan run by other
    processes) whose finished arms are added to this folder's ``arms.json`` first.
    ``probe_only``: stop after the learning-rate probe (a probe split over processes by
    ``methods``, whose folders the whole-model runs then add)."""
    if probe_only and not cfg.lr_probe_rates:
        raise ValueError("probe_only needs lr_probe_rates (this config has no rate probe)")
    t0 = time.time()
    out = Path(out_dir)
    check_apart(out, source_chain(cfg.model), "share experiment folder")
    _check_budgets(cfg)  # from the shapes alone, before any calibration
    others = [read_finished_runs(f, "structlm experiment share") for f in add_runs]
    with run_folder_lock(out, "share experiment"):  # one writer per run folder
        return _run_experiment_locked(cfg, out, t0, progress, analytic_only, others,
                                      probe_only)


def _check_budgets(cfg: ExperimentConfig) -> None:
    """Every whole-model arm whose ranks follow from the shapes meets its budget."""
    from structlm.hf.adapters import get_adapter
    from structlm.hf.loading import load_model

    arms = [(method, _whole_ccfg(cfg, method, red))
            for red in (cfg.reductions if cfg.whole_model else [])
            for method in methods_at(cfg, red)]
    if arms:
        adapter = get_adapter(load_model(cfg.model, weights=False).model)
        check_budgets_feasible(adapter, arms, cfg.budget_tolerance)


def _draw(cfg: ExperimentConfig, calib_seed: int, progress: bool) -> Prepared:
    """The model, split, evaluation windows and one calibration draw (``calib_seed``);
    the split, the validation and the test windows are the same for every draw."""
    return prepare(cfg.model, cfg.corpus, cfg.second_corpus, calib_tokens=cfg.calib_tokens,
                   eval_tokens=cfg.eval_tokens, progress=progress,
                   calib_seed=None if calib_seed == 0 else calib_seed,
                   val_tokens=cfg.val_tokens)


def _run_experiment_locked(cfg: ExperimentConfig, out: Path, t0: float, progress: bool,
                           analytic_only: bool, others: list[dict[str, Any]] | None = None,
                           probe_only: bool = False) -> dict[str, Any]:
    """The body of the run, under the run folder's lock."""
    from structlm.experiments.share.report import write_experiment_report

    atomic_write_text(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=1))
    cache = ArmCache(out / "arms.json", cfg)
    if merge_finished_runs(cache.done, others or []):  # before any work
        atomic_write_text(cache.path, json.dumps(cache.done))
    prep = _draw(cfg, cfg.calib_seeds[0], progress)
    texts = list(prep.eval_ids)
    res: dict[str, Any] = {"model": prep.loaded.model_id, "model_note": prep.loaded.note,
                           "split": prep.split.describe(), "eval_texts": texts,
                           "text": prep.text,
                           "calibration": dict(prep.calibration.meta if prep.calibration
                                               else {})}
    if cfg.beside is not None:  # checked against this run's text before any work
        res["beside"] = load_beside(cfg.beside, res)
    res["eval_original"] = evaluate_all(prep.loaded.model, prep.eval_ids, progress=False)
    res["ppl_original"] = {k: v["ppl"] for k, v in res["eval_original"].items()}
    draws = [_draw(cfg, s, progress) for s in cfg.calib_seeds[1:]]
    res["calib_seeds"] = list(cfg.calib_seeds)
    cells, info = _cells(cfg, prep, cache, progress, draws)  # the analytic phase
    probed, res["lr_probe"] = _probe(cfg, prep, cache, progress, run=not analytic_only)
    if probed:
        cells, info = _cells(cfg, prep, cache, progress, draws, probed)

    throttle = PlotThrottle()

    def write(final: bool = False) -> dict[str, Any]:
        res.update(_assemble(cfg, prep, cache, cells, info, texts))
        # distinct runs: the scope's "all" arms are whole-model arms already
        runs = {cache.tuned_key(c.prep or prep, c.ccfg, c.ft, s) for c in cells
                for s in c.seeds}
        if res["continue_whole"] and cfg.continue_unplateaued_to:  # planned once decided
            runs |= {cache.continuation_key(p, c.ccfg, c.ft, s, cfg.continue_unplateaued_to)
                     for c, s, p in _whole_runs(cfg, prep, cells)}
        res["finetuned_runs"] = {"done": len(runs & cache.done.keys()),
                                 "planned": len(runs)}
        res["seconds"] = time.time() - t0
        atomic_write_text(out / "experiment.json", json.dumps(clean_json(res), indent=1))
        write_experiment_report(res, cfg, out, plots=throttle.due(final))
        return res

    write(final=analytic_only or probe_only)
    if analytic_only or probe_only:
        return res
    queue = sorted(((p, i, s) for i, c in enumerate(cells)
                    for s, p in zip(c.seeds, c.priority, strict=True)), key=lambda x: (x[0], x[1]))
    for _, i, s in queue:
        c = cells[i]
        if c.ft.steps > 0 and not cache.has_tuned(c.prep or prep, c.ccfg, c.ft, s):
            cache.tuned(c.prep or prep, c.ccfg, c.ft, s, progress)
            write()
    # then, if any whole-model run had not plateaued, every one of them taken further
    if continue_whole(cfg, prep, cache, cells) and cfg.continue_unplateaued_to:
        for c, s, p in _whole_runs(cfg, prep, cells):
            if cache.continued(p, c.ccfg, c.ft, s, cfg.continue_unplateaued_to, progress,
                               run=False) is None:
                cache.continued(p, c.ccfg, c.ft, s, cfg.continue_unplateaued_to, progress,
                                run=True)
                write()
    return write(final=True)
