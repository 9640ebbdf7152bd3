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
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from structlm.atomic import atomic_write_text, clean_json
from structlm.experiments.finished_runs import merge_finished_runs, read_finished_runs
from structlm.experiments.plot_throttle import PlotThrottle
from structlm.experiments.share.beside import load_beside
from structlm.experiments.share.config import ExperimentConfig, whole_finetune
from structlm.folders import check_apart, run_folder_lock
from structlm.hf.adapters import MatrixType, get_adapter
from structlm.hf.finetune import FinetuneConfig, finetune
from structlm.hf.pipeline import Prepared, evaluate_all, prepare, spread_windows
from structlm.share.compress import (
    CompressionConfig,
    TypeRanks,
    compress_model,
    get_method,
    plan_types,
)
from structlm.share.compress.io import source_chain
from structlm.share.compress.methods import (
    BASIS_SHARING_METHOD,
    HYBRID_METHOD,
    SHARED_METHOD,
)

__all__ = ["ExperimentConfig", "draw_seeds", "run_experiment"]


def _ppl(model: Any, prep: Prepared) -> dict[str, float]:
    return {k: v["ppl"] for k, v in evaluate_all(model, prep.eval_ids, progress=False).items()}


def _parameter_state(p: torch.nn.Parameter) -> tuple[Any, ...]:
    """What an arm must leave unchanged in a shared parameter: its storage, dtype,
    device and shape (``.data`` swaps and ``.to`` do not bump the version counter) and
    its version counter (in-place writes)."""
    return (p.data_ptr(), p.dtype, p.device, tuple(p.shape), p._version)


def _parameter_sharing_copy(model: Any) -> tuple[Any, Callable[[], None]]:
    """A copy of ``model``'s module tree that shares its parameters (buffers are copied),
    and a check that raises if any shared parameter was changed since, then gives each
    its ``requires_grad`` flag back.

    Compression replaces modules (the copy's dense weights are only read) and fine-tuning
    trains only the new modules' factors, so an arm needs no second copy of the weights:
    on Qwen2.5-Coder-0.5B that copy was 2.5 GB of a peak that did not fit beside the
    other experiments. Every arm calls the check after its work (storage, dtype, device,
    shape and version counter of every shared parameter: exact and free), so a method
    that wrote into a weight it was given fails loudly instead of corrupting the next
    arm's source; fine-tuning freezes every parameter of its copy, the shared ones too,
    and the check restores their flags."""
    params = list(model.parameters())
    states = [_parameter_state(p) for p in params]
    flags = [p.requires_grad for p in params]
    copied = copy.deepcopy(model, memo={id(p): p for p in params})

    def check() -> None:
        changed = [i for i, (p, st) in enumerate(zip(params, states, strict=True))
                   if _parameter_state(p) != st]
        if changed:
            raise AssertionError(f"{len(changed)} parameters of the source model were "
                                 f"changed by an arm (first: #{changed[0]})")
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)

    return copied, check


def _compress(prep: Prepared, ccfg: CompressionConfig, progress: bool = False
              ) -> tuple[Any, dict[str, Any], Callable[[], None]]:
    """A compressed copy of the model (deterministic: no seed involved) sharing the
    uncompressed parameters with the source, and the check that they stayed unchanged."""
    model, check = _parameter_sharing_copy(prep.loaded.model)
    assert prep.calibration is not None
    rep = compress_model(get_adapter(model), prep.calibration, ccfg, progress=progress,
                         calib_tokens=prep.calib_ids)
    check()
    return model, rep, check


def _analytic(prep: Prepared, ccfg: CompressionConfig, progress: bool = False
              ) -> dict[str, Any]:
    """Compress a fresh copy and evaluate it before any training."""
    t0 = time.time()
    model, rep, check = _compress(prep, ccfg, progress)
    out: dict[str, Any] = {
        "method": ccfg.method, "types": ccfg.types, "reduction": ccfg.target_reduction,
        "ratio": rep["ratio"], "stored_parameters": rep["stored_parameters"],
        "original_parameters": rep["original_parameters"],
        "energy_kept": {t: d["mean_energy_kept"] for t, d in rep["types"].items()},
        "ranks": {t: {"k_out": d["k_out"], "k_in": d["k_in"], "r": d["r"],
                      "method": d["method"], "groups": len(d["group_sizes"])}
                  for t, d in rep["types"].items()},
        "stored_by_type": {t: [d["stored_parameters"], d["original_parameters"]]
                           for t, d in rep["types"].items()},
        "residual_share_of_basis_error": {
            t: sum(d["residual_share_of_basis_error"]) / len(d["residual_share_of_basis_error"])
            for t, d in rep["types"].items() if "residual_share_of_basis_error" in d},
        "ppl_analytic": _ppl(model, prep), "analytic_seconds": time.time() - t0}
    check()
    if "update" in rep:
        out["update"] = rep["update"]
    return out


def token_macs_ratio(prep: Prepared, ccfg: CompressionConfig, arm: dict[str, Any]) -> float:
    """Decoder projection MACs per token of the compressed model (one row, the modules'
    own order) over the original's, from the arm's recorded ranks: every linear type of
    every layer counted, the uncompressed ones at ``out·in``."""
    ad = prep.adapter
    L = ad.num_layers
    dense = {t: L * ad.layers[0].weight(t).numel() for t in MatrixType}
    now = dict(dense)
    for plan in plan_types(ad, ccfg):
        r = arm["ranks"][plan.type.value]
        out, inn = plan.shape
        now[plan.type] = get_method(r["method"]).token_macs(
            out, inn, TypeRanks(r["k_out"], r["k_in"], r["r"]), [len(g) for g in plan.groups],
            plan.parts)
    return sum(now.values()) / sum(dense.values())


def _tuned(prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig, seed: int,
           progress: bool, state_path: Path | None = None,
           continue_from: Path | None = None) -> dict[str, Any]:
    """Compress a fresh copy, fine-tune it with ``seed`` (resuming from ``state_path``
    if a killed run left one, else continuing a shorter run's ``continue_from`` state if
    given), evaluate."""
    t0 = time.time()
    model, _, check = _compress(prep, ccfg, progress)
    torch.manual_seed(seed)
    in_domain = next(iter(prep.eval_ids.values()))
    ftc = dataclasses.replace(ft, seed=seed)
    curve = finetune(model, prep.train_ids, spread_windows(in_domain, ft.eval_tokens), ftc,
                     progress, state_path=state_path, prefix=prep.window_prefix,
                     continue_from=continue_from)
    check()
    return {"seed": seed, "finetune": dataclasses.asdict(ftc), "curve": curve,
            "ppl_finetuned": _ppl(model, prep), "finetune_seconds": time.time() - t0}


class _ArmCache:
    """Finished arms in ``arms.json`` next to the report, written atomically after each
    one, so a killed experiment resumes where it stopped. The analytic part of an arm is
    keyed by the compression config (it does not depend on the seed); a fine-tuned part by
    the compression config, the fine-tuning config and the seed. A fine-tuning run in
    progress keeps its state in ``finetune-state/<hash of its key>.pt`` beside
    ``arms.json`` (every few steps), so a kill mid-run loses minutes, not the run."""

    def __init__(self, path: Path, cfg: ExperimentConfig) -> None:
        self.path = path
        self.base = {"calib_tokens": cfg.calib_tokens, "eval_tokens": cfg.eval_tokens,
                     "corpus": cfg.corpus, "second_corpus": cfg.second_corpus,
                     "protocol": "windows across documents"}
        self.done: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        self.keep_states = cfg.keep_finetune_states

    def _key(self, prep: Prepared, ccfg: CompressionConfig, **extra: Any) -> str:
        draw = _calib_seed(prep)
        if draw:  # the first draw's keys predate the field: they stay as they were
            extra = {**extra, "calib_seed": draw}
        return json.dumps({**self.base, "model": prep.loaded.model_id,
                           "compression": dataclasses.asdict(ccfg), **extra}, sort_keys=True)

    def state_path(self, key: str, final: bool = False) -> Path:
        """Where the fine-tuning run of ``key`` keeps its resumable state (``final``: where
        a finished run's state is kept with ``keep_finetune_states``)."""
        return self.path.parent / ("finetune-final" if final else "finetune-state") / (
            hashlib.sha1(key.encode()).hexdigest()[:16] + ".pt")

    def _get(self, key: str, make: Any, label: str, progress: bool) -> dict[str, Any]:
        if key not in self.done:
            if progress:
                print(f"[arm] {label}", flush=True)
            self.done[key] = clean_json(make())
            atomic_write_text(self.path, json.dumps(self.done))
        self._settle_state(key)  # also after a kill between the write and the move
        return self.done[key]

    def _settle_state(self, key: str) -> None:
        """A recorded run's state: kept in ``finetune-final/`` (``keep_finetune_states``)
        or deleted — the state is spent."""
        state = self.state_path(key)
        if not state.exists():
            return
        if self.keep_states:
            self.state_path(key, final=True).parent.mkdir(exist_ok=True)
            os.replace(state, self.state_path(key, final=True))
        state.unlink(missing_ok=True)

    def analytic(self, prep: Prepared, ccfg: CompressionConfig,
                 progress: bool) -> dict[str, Any]:
        label = f"{ccfg.method} on {ccfg.types} at {ccfg.target_reduction or ccfg.k_fraction}"
        return self._get(self._key(prep, ccfg, part="analytic"),
                         lambda: _analytic(prep, ccfg, progress), label + " (analytic)", progress)

    def tuned(self, prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig, seed: int,
              progress: bool) -> dict[str, Any] | None:
        """The fine-tuned part (``None`` if it is not done and ``run`` is False)."""
        key = self.tuned_key(prep, ccfg, ft, seed)
        label = (f"{ccfg.method} on {ccfg.types} at "
                 f"{ccfg.target_reduction or ccfg.k_fraction}, fine-tuned, seed {seed}")
        return self._get(key, lambda: _tuned(prep, ccfg, ft, seed, progress,
                                             self.state_path(key)), label, progress)

    def tuned_key(self, prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig,
                  seed: int) -> str:
        """The key of one fine-tuning run in ``arms.json``."""
        return self._key(prep, ccfg, part="finetuned", seed=seed,
                         finetune=dataclasses.asdict(ft))

    def has_tuned(self, prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig,
                  seed: int) -> bool:
        return self.tuned_key(prep, ccfg, ft, seed) in self.done

    def continuation_key(self, prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig,
                         seed: int, to_steps: int | None, window: int) -> str | None:
        """The key of the continuation a finished run calls for (``None``: none asked,
        the run is not done, or it has plateaued)."""
        from structlm.experiments.share.report import run_plateaued

        if to_steps is None or not self.has_tuned(prep, ccfg, ft, seed):
            return None
        if run_plateaued(self.done[self.tuned_key(prep, ccfg, ft, seed)], window) is not False:
            return None
        return self.tuned_key(prep, ccfg, dataclasses.replace(ft, steps=to_steps), seed)

    def continued(self, prep: Prepared, ccfg: CompressionConfig, ft: FinetuneConfig,
                  seed: int, to_steps: int | None, window: int, progress: bool,
                  run: bool) -> dict[str, Any] | None:
        """The ``ft.steps`` run continued to ``to_steps`` where it has not plateaued by
        the rule on the run alone (``None``: no continuation asked, the run is not done or
        has plateaued, or the continuation is not done and ``run`` is False). It starts
        from the run's kept final state, or from step 0 where none was kept."""
        key = self.continuation_key(prep, ccfg, ft, seed, to_steps, window)
        if key is None:
            return None
        short_key = self.tuned_key(prep, ccfg, ft, seed)
        longer = dataclasses.replace(ft, steps=to_steps)
        if key not in self.done and not run:
            return None
        final = self.state_path(short_key, final=True)
        label = (f"{ccfg.method} on {ccfg.types} at {ccfg.target_reduction}, fine-tuned, "
                 f"seed {seed}, continued {ft.steps} -> {to_steps} steps")
        return self._get(key, lambda: _tuned(prep, ccfg, longer, seed, progress,
                                             self.state_path(key),
                                             final if final.exists() else None),
                         label, progress)


def draw_seeds(seeds: list[int], draw: int, all_seeds: list[int]) -> list[int]:
    """The fine-tuning seeds of calibration draw number ``draw`` (0: the first):
    ``seeds`` shifted by ``draw × (max(all_seeds) + 1)``, so every (draw, seed) pair has
    its own batch order and the fine-tuned ranges span both sources of variance."""
    return [s + draw * (max(all_seeds) + 1) for s in seeds]


def _calib_seed(prep: Prepared) -> int:
    """The calibration draw ``prep`` was prepared with (the split's seed, 0, unless
    another draw was asked for)."""
    return int(prep.calibration.meta.get("calib_seed", 0)) if prep.calibration else 0


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


def _cells(cfg: ExperimentConfig, prep: Prepared, cache: _ArmCache, progress: bool,
           draws: list[Prepared] | None = None) -> tuple[list[_Cell], dict[str, Any]]:
    """Every setting (the analytic phase runs as they are made: the seed regime's other
    methods need the shared arm's storage)."""
    cells: list[_Cell] = []
    info: dict[str, Any] = {}
    n_s = len(cfg.seeds)
    if cfg.seed_regime and cfg.seed_methods:  # shared first: checked by the config
        ref = CompressionConfig(method=SHARED_METHOD.name, types=cfg.seed_types,
                                k_fraction=cfg.seed_k_fraction)
        a = cache.analytic(prep, ref, progress)
        budget = 1 - a["stored_parameters"] / a["original_parameters"]
        info = {"k": round(cfg.seed_k_fraction * prep.adapter.hidden_size),
                "types": cfg.seed_types, "reduction_of_shared": budget}
        for method in cfg.seed_methods:
            ccfg = ref if method == SHARED_METHOD.name else CompressionConfig(
                method=method, types=cfg.seed_types, target_reduction=budget,
                group_size=cfg.group_size, residual_rank=cfg.residual_rank)
            cells.append(_Cell("seed", ccfg, cfg.seed_finetune, cfg.seeds,
                               [10 + 100 * i for i in range(n_s)]))
    for j, red in enumerate(cfg.reductions):
        multi = red in cfg.multi_seed_reductions
        for d, draw in enumerate([None, *(draws or [])]):
            for method in cfg.methods:
                tuned = cfg.finetune_methods is None or method in cfg.finetune_methods
                seeds = draw_seeds((cfg.seeds if multi else cfg.seeds[:1]) if tuned else [],
                                   d, cfg.seeds)
                ccfg = CompressionConfig(method=method, types=cfg.types, target_reduction=red,
                                         residual_rank=cfg.residual_rank,
                                         group_size=cfg.group_size,
                                         update=cfg.update and method == BASIS_SHARING_METHOD.name)
                first = 0 if multi else 5  # seed 0 of the multi-seed budgets first
                cells.append(_Cell("whole", ccfg, whole_finetune(cfg, method), seeds,
                                   [first + j + 100 * i + d for i in range(len(seeds))], draw))
    if cfg.scope:
        for method in (SHARED_METHOD.name, HYBRID_METHOD.name):
            for types in ("attn", "mlp", "all"):
                ccfg = CompressionConfig(method=method, types=types,
                                         target_reduction=cfg.scope_reduction,
                                         residual_rank=cfg.residual_rank)
                cells.append(_Cell("scope", ccfg, cfg.finetune, cfg.seeds[:1], [50]))
    for c in cells:
        a = cache.analytic(c.prep or prep, c.ccfg, progress)
        if c.section == "whole":
            _check_budget(a, (1 - c.ccfg.target_reduction) * a["original_parameters"],
                          cfg.budget_tolerance)
    return cells, info


def _assemble(cfg: ExperimentConfig, prep: Prepared, cache: _ArmCache, cells: list[_Cell],
              info: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    """Sections of the results from whatever the cache holds now."""
    out: dict[str, Any] = {"whole_model": [], "scope": []}
    seed_entries = []
    whole: dict[tuple[str, float | None], dict[str, Any]] = {}
    for c in cells:
        p = c.prep or prep
        a = cache.analytic(p, c.ccfg, False)
        a = {**a, "token_macs_ratio": token_macs_ratio(p, c.ccfg, a),
             "calib_seed": _calib_seed(p)}
        arms = []
        for s in c.seeds:
            if not cache.has_tuned(p, c.ccfg, c.ft, s):
                continue
            longer = (cache.continued(p, c.ccfg, c.ft, s, cfg.continue_unplateaued_to,
                                      cfg.plateau_window, False, run=False)
                      if c.section == "whole" else None)
            if longer is not None:
                out.setdefault("continued", []).append(
                    {"method": c.ccfg.method, "reduction": c.ccfg.target_reduction,
                     "seed": s, "calib_seed": _calib_seed(p), "from_steps": c.ft.steps,
                     "to_steps": cfg.continue_unplateaued_to})
            arms.append({**a, **(longer or cache.tuned(p, c.ccfg, c.ft, s, False))})
        if c.section == "whole" and c.prep is not None:  # another draw of an entry
            e = whole[(c.ccfg.method, c.ccfg.target_reduction)]
            e["analytic_by_draw"][str(_calib_seed(p))] = a["ppl_analytic"]
            e["seeds_planned"] += [f"{s} (draw {_calib_seed(p)})" for s in c.seeds]
            if arms:
                e["arms"] = [x for x in e["arms"] if "ppl_finetuned" in x] + arms
                tuned = [x for x in e["arms"] if "ppl_finetuned" in x]
                e["finetuned"] = {t: _summary(tuned, "ppl_finetuned", t) for t in texts}
            continue
        entry = {"method": c.ccfg.method, "reduction": c.ccfg.target_reduction,
                 "arms": arms or [a], "analytic": a["ppl_analytic"],
                 "finetuned": {t: _summary(arms, "ppl_finetuned", t) for t in texts},
                 "seeds_planned": list(c.seeds)}
        if c.section == "whole":
            entry["analytic_by_draw"] = {str(_calib_seed(p)): a["ppl_analytic"]}
            whole[(c.ccfg.method, c.ccfg.target_reduction)] = entry
            out["whole_model"].append(entry)
        elif c.section == "seed":
            seed_entries.append(entry)
        else:
            out["scope"].append(entry["arms"][0])
    if seed_entries:
        out["seed_regime"] = {**info, "entries": seed_entries}
    return out


def run_experiment(cfg: ExperimentConfig, out_dir: str | Path, progress: bool = True,
                   analytic_only: bool = False,
                   add_runs: list[str | Path] | tuple[str | Path, ...] = ()
                   ) -> dict[str, Any]:
    """Run the regimes: first every arm's compression and analytic evaluation, then the
    fine-tuning runs in priority order (seed 0 of every whole-model budget first), the
    report rewritten after each; ``analytic_only`` stops after the first phase. Writes
    ``experiment.json``, ``report.md`` and plots. ``add_runs``: other folders of the same
    experiment (parts of the plan run by other processes) whose finished arms are added
    to this folder's ``arms.json`` first."""
    t0 = time.time()
    out = Path(out_dir)
    check_apart(out, source_chain(cfg.model), "share experiment folder")
    others = [read_finished_runs(f, "structlm experiment share") for f in add_runs]
    with run_folder_lock(out, "share experiment"):  # one writer per run folder
        return _run_experiment_locked(cfg, out, t0, progress, analytic_only, others)


def _draw(cfg: ExperimentConfig, calib_seed: int, progress: bool) -> Prepared:
    """The model, split, evaluation windows and one calibration draw (``calib_seed``);
    the split and evaluation windows are the same for every draw."""
    return prepare(cfg.model, cfg.corpus, cfg.second_corpus, calib_tokens=cfg.calib_tokens,
                   eval_tokens=cfg.eval_tokens, progress=progress,
                   calib_seed=None if calib_seed == 0 else calib_seed)


def _run_experiment_locked(cfg: ExperimentConfig, out: Path, t0: float, progress: bool,
                           analytic_only: bool, others: list[dict[str, Any]] | None = None
                           ) -> dict[str, Any]:
    """The body of the run, under the run folder's lock."""
    from structlm.experiments.share.report import write_experiment_report

    atomic_write_text(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=1))
    cache = _ArmCache(out / "arms.json", cfg)
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
    res["ppl_original"] = _ppl(prep.loaded.model, prep)
    draws = [_draw(cfg, s, progress) for s in cfg.calib_seeds[1:]]
    res["calib_seeds"] = list(cfg.calib_seeds)
    cells, info = _cells(cfg, prep, cache, progress, draws)

    throttle = PlotThrottle()

    def write(final: bool = False) -> dict[str, Any]:
        res.update(_assemble(cfg, prep, cache, cells, info, texts))
        # distinct runs: the scope's "all" arms are whole-model arms already
        runs = {cache.tuned_key(c.prep or prep, c.ccfg, c.ft, s) for c in cells
                for s in c.seeds}
        # and the continuations the finished runs call for (planned once they are known)
        runs |= {k for c in cells if c.section == "whole" for s in c.seeds
                 if (k := cache.continuation_key(c.prep or prep, c.ccfg, c.ft, s,
                                                 cfg.continue_unplateaued_to,
                                                 cfg.plateau_window)) is not None}
        res["finetuned_runs"] = {"done": len(runs & cache.done.keys()),
                                 "planned": len(runs)}
        res["seconds"] = time.time() - t0
        atomic_write_text(out / "experiment.json", json.dumps(clean_json(res), indent=1))
        write_experiment_report(res, cfg, out, plots=throttle.due(final))
        return res

    write(final=analytic_only)
    if analytic_only:
        return res
    queue = sorted(((p, i, s) for i, c in enumerate(cells)
                    for s, p in zip(c.seeds, c.priority, strict=True)), key=lambda x: (x[0], x[1]))
    for _, i, s in queue:
        c = cells[i]
        if c.ft.steps > 0 and not cache.has_tuned(c.prep or prep, c.ccfg, c.ft, s):
            cache.tuned(c.prep or prep, c.ccfg, c.ft, s, progress)
            write()
    # then the whole-model runs still falling at their step count, taken further
    for _, i, s in queue:
        c = cells[i]
        if (c.section == "whole" and c.ft.steps > 0 and cfg.continue_unplateaued_to
                and cache.continued(c.prep or prep, c.ccfg, c.ft, s,
                                    cfg.continue_unplateaued_to, cfg.plateau_window,
                                    progress, run=False) is None
                and cache.continued(c.prep or prep, c.ccfg, c.ft, s,
                                    cfg.continue_unplateaued_to, cfg.plateau_window,
                                    progress, run=True) is not None):
            write()
    return write(final=True)
