"""``structlm experiment convert MODEL``: change the product of a pretrained model, heal it, and
compare it with equal-MAC baselines healed the same way.

For every target (``mlp``: the FFN projections; ``attn``: the attention projections)
and every algebra, the arms (:mod:`structlm.experiments.convert.arms`) are the algebra
conversion in each of its start ``variants`` (``copy``, ``calibrated``,
``calibrated+permute``, ``...+distill``), FFN-width pruning (``prune``, FFN only) and
whitened low-rank factorisation (``svd``) at the same projection MACs, and the unchanged
model healed the same way (``dense``, the control that separates repair from domain
adaptation).

Every arm starts from a fresh copy of the loaded model and is evaluated right after the
change (``changed``), after distillation for the ``+distill`` variants (``distilled``:
``distill`` steps of layer-wise distillation toward the dense modules, on top of the
healing budget) and after healing (``healed``): the same :class:`FinetuneConfig` for
every arm (steps, rates, batches of calibration text, seed), training the parameters of
the changed modules (the same modules for the dense control). Projection MACs per token
are asserted equal to the algebra arm's within ``mac_tolerance``. Perplexity uses the
share pipeline's protocol (>= ``eval_tokens`` scored tokens per text, windows drawn
across all held-out documents, float64 sums), in-domain and on the other-domain text.
For the algebra arms, the error of every converted module against the dense model
(:func:`~structlm.convert.diagnose.module_errors`: on its own input and at its place in
the model, per position type) is measured on held-out in-domain windows right after the
change and after healing. Finished arms are kept in ``arms.json`` (a killed run
resumes; distillation and healing runs in progress keep their state every 25 steps).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
from torch import nn

from structlm.atomic import atomic_write_text, clean_json
from structlm.config import (
    ConfigError,
    Distinct,
    NonEmpty,
    OneOf,
    Range,
    dataclass_from_dict,
    validated,
)
from structlm.convert.convert import AlgebraConfig
from structlm.convert.diagnose import module_errors
from structlm.convert.distill import ModuleDistillation, dense_teacher
from structlm.experiments.convert.arms import (
    BASELINES,
    VARIANTS,
    Arm,
    change_model,
    mac_ratio,
    variant_parts,
)
from structlm.experiments.convert.budget import check_baseline_budgets
from structlm.experiments.finished_runs import merge_finished_runs, read_finished_runs
from structlm.experiments.plot_throttle import PlotThrottle
from structlm.folders import check_apart, run_folder_lock
from structlm.hf.adapters import get_adapter, parse_types
from structlm.hf.finetune import FinetuneConfig, finetune
from structlm.hf.macs import projection_macs, projection_parameters
from structlm.hf.pipeline import Prepared, evaluate_all, prepare, validation_windows
from structlm.share.compress.io import source_chain

__all__ = ["ConvertExperimentConfig", "planned_runs", "run_convert_experiment"]

SAVE_EVERY = 25  # steps between the saved states of a distillation or healing run
DIAGNOSE_WINDOWS = 8  # held-out in-domain windows of the per-module error breakdown


def _heal_default() -> FinetuneConfig:
    return FinetuneConfig(steps=100, warmup=5, eval_every=25)


def _no_distill() -> FinetuneConfig:
    return FinetuneConfig(steps=0, warmup=10, eval_every=50)


_TARGET = Annotated[str, OneOf("mlp", "attn")]
_VARIANT = Annotated[str, OneOf(*VARIANTS)]


@dataclass
@validated
class ConvertExperimentConfig:
    """The conversion experiment (every field settable from YAML or the CLI)."""

    model: Annotated[str, NonEmpty()] = "smollm2"
    corpus: Annotated[str, NonEmpty()] = "austen"
    """Calibration and healing text; its held-out documents are the in-domain text."""
    second_corpus: str = "shakespeare"
    """Other-domain evaluation text."""
    calib_tokens: Annotated[int, Range(ge=512, note="one calibration window")] = 32768
    """Calibration tokens (windows across all calibration documents, seeded)."""
    eval_tokens: Annotated[int, Range(ge=1)] = 16384
    """Scored tokens per evaluation text (windows across all held-out documents)."""
    algebras: Annotated[list[str], NonEmpty(), Distinct()] = field(
        default_factory=lambda: ["Q2^2", "Q4"])
    """Algebras the projections are converted to (each sets one MAC budget)."""
    targets: Annotated[list[_TARGET], NonEmpty(), Distinct()] = field(
        default_factory=lambda: ["mlp", "attn"])
    """Projection groups converted: mlp (FFN) and/or attn."""
    schedule: Annotated[str, NonEmpty()] = "cyclic"
    """Position-type schedule of the converted layers."""
    baselines: Annotated[list[Annotated[str, OneOf(*BASELINES)]], Distinct()] = field(
        default_factory=lambda: list(BASELINES))
    """Equal-MAC baselines: prune (FFN width; mlp only) and/or svd (low rank)."""
    variants: Annotated[list[_VARIANT], NonEmpty(), Distinct()] = field(
        default_factory=lambda: ["copy"])
    """How the FFN algebra arms start, one arm per variant (``copy``: every weight kept;
    ``calibrated``: refitted on calibration activations; ``+permute``: units permuted
    first; ``+distill``: layer-wise distillation before healing)."""
    attn_variants: Annotated[list[_VARIANT] | None, NonEmpty(), Distinct()] = None
    """The same for the attention algebra arms (``None``: ``variants``)."""
    attn_algebras: Annotated[list[str] | None, NonEmpty(), Distinct()] = None
    """The budgets (some of ``algebras``) of the attention arms (``None``: all)."""
    dense_control: bool = True
    """Also heal the unchanged model the same way (the domain-adaptation control)."""
    heal: FinetuneConfig = field(default_factory=_heal_default)
    """Healing of every arm (the same for all; only the trained modules differ; at least
    one step)."""
    distill: FinetuneConfig = field(default_factory=_no_distill)
    """Layer-wise distillation of the ``+distill`` variants before their healing (at
    least one step when a variant distils)."""
    plateau_steps: Annotated[int, Range(ge=1)] = 50
    """The plateau check of every healing curve looks this many steps back..."""
    plateau_change: Annotated[float, Range(gt=0, lt=1)] = 0.02
    """...and calls the curve flat when its in-domain perplexity changed by less than
    this fraction there (reported per arm, with the learning rate at that point)."""
    seeds: Annotated[list[Annotated[int, Range(ge=0)]], NonEmpty(), Distinct()] = field(
        default_factory=lambda: [0])
    """Healing seeds (batch order)."""
    seed_targets: Annotated[list[_TARGET] | None, Distinct()] = None
    """Targets whose algebra and baseline arms are healed with every seed (the verdict
    rule needs at least two per arm); every other arm, the dense controls included, with
    ``seeds[0]`` only. ``None``: every arm with every seed."""
    seed_variants: Annotated[list[_VARIANT] | None, Distinct()] = None
    """Of those algebra arms, the variants healed with every seed (``None``: all)."""
    mac_tolerance: Annotated[float, Range(ge=0, lt=1)] = 0.01
    """Baselines' projection MACs must lie within this fraction below the algebra's."""

    def __post_init__(self) -> None:
        """Cross-field checks (each field's own range is checked by ``@validated``)."""
        if not isinstance(self.heal, FinetuneConfig):
            raise ConfigError(f"heal: {self.heal!r} is not a mapping of FinetuneConfig keys")
        for name in self.algebras:
            AlgebraConfig(name, self.schedule)  # raises naming a bad algebra or schedule
        stray = [a for a in self.attn_algebras or [] if a not in self.algebras]
        if stray:
            raise ConfigError(f"attn_algebras {stray}: expected some of the algebras "
                              f"{self.algebras}")
        bad_seed_targets = [t for t in self.seed_targets or [] if t not in self.targets]
        if bad_seed_targets:
            raise ConfigError(f"seed_targets {bad_seed_targets}: expected some of the "
                              f"targets {self.targets}")
        if self.baselines and "mlp" not in self.targets and set(self.baselines) == {"prune"}:
            raise ConfigError(f"baselines: {self.baselines} would run no arm: prune cuts the "
                              f"FFN width, so it applies to target mlp only, and targets are "
                              f"{self.targets}; add mlp to targets, use svd, or give no "
                              "baselines")
        if self.heal.steps < 1:
            raise ConfigError(f"heal.steps: {self.heal.steps} is out of range: expected >= 1 "
                              "(every arm is healed)")
        if not isinstance(self.distill, FinetuneConfig):
            raise ConfigError(f"distill: {self.distill!r} is not a mapping of FinetuneConfig "
                              "keys")
        distils = [v for v in self.variants + (self.attn_variants or [])
                   if variant_parts(v)[2]]
        if distils and self.distill.steps < 1:
            raise ConfigError(f"distill.steps: {self.distill.steps} is out of range: variants "
                              f"{distils} distil, so expected >= 1")
        unused = [v for v in self.seed_variants or []
                  if v not in self.variants + (self.attn_variants or [])]
        if unused:
            raise ConfigError(f"seed_variants {unused}: expected some of the variants "
                              f"{self.variants + (self.attn_variants or [])}")

    def algebras_for(self, target: str) -> list[str]:
        """The budgets of the arms on ``target``."""
        return (self.attn_algebras or self.algebras) if target == "attn" else self.algebras

    def variants_for(self, target: str) -> list[str]:
        """The algebra arms' variants on ``target``."""
        return (self.attn_variants or self.variants) if target == "attn" else self.variants

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ConvertExperimentConfig:
        return dataclass_from_dict(cls, raw, {"heal": FinetuneConfig,
                                              "distill": FinetuneConfig})


def _arms(cfg: ConvertExperimentConfig) -> list[Arm]:
    """Per target: per algebra its first variant (the main arm), its baselines, its other
    variants; then the dense control."""
    arms = []
    for target in cfg.targets:
        for alg in cfg.algebras_for(target):
            variants = [Arm("algebra", target, alg, v) for v in cfg.variants_for(target)]
            arms += variants[:1] + [Arm(b, target, alg) for b in cfg.baselines
                                    if not (b == "prune" and target != "mlp")] + variants[1:]
        if cfg.dense_control:
            arms.append(Arm("dense", target, ""))
    return arms


def planned_runs(cfg: ConvertExperimentConfig) -> list[tuple[Arm, int]]:
    """Every (arm, seed) the experiment runs, seed by seed: every arm with ``seeds[0]``
    first (an interrupted run still has every row of the table once), then the further
    seeds of the arms in ``seed_targets`` (``None``: every arm with every seed) whose
    variant is in ``seed_variants`` (``None``: every variant)."""
    runs = []
    for i, seed in enumerate(cfg.seeds):
        for arm in _arms(cfg):
            every_seed = (cfg.seed_targets is None or (
                arm.kind != "dense" and arm.target in cfg.seed_targets)) and (
                arm.kind != "algebra" or cfg.seed_variants is None
                or arm.variant in cfg.seed_variants)
            if i == 0 or every_seed:
                runs.append((arm, seed))
    return runs


def _ppl(model: nn.Module, prep: Prepared) -> dict[str, float]:
    return {k: v["ppl"] for k, v in evaluate_all(model, prep.eval_ids, progress=False).items()}


def _run_arm(arm: Arm, seed: int, prep: Prepared, cfg: ConvertExperimentConfig,
             state_path: Path, progress: bool) -> dict[str, Any]:
    t0 = time.time()
    model = copy.deepcopy(prep.loaded.model)
    params, conversion = change_model(model, arm, prep, cfg.schedule, progress)
    if arm.kind in BASELINES:  # before hours of healing, and before anything is recorded
        _check_budget(arm, float(projection_macs(model)), prep, cfg)
    out: dict[str, Any] = {
        "arm": arm.name, "kind": arm.kind, "target": arm.target, "budget": arm.budget,
        "variant": arm.variant, "seed": seed,
        "projection_macs": float(projection_macs(model)),
        "projection_parameters": projection_parameters(model),
        "trained_parameters": sum(p.numel() for p in params),
        "ppl_changed": _ppl(model, prep)}
    if conversion is not None:
        out["conversion"] = {k: conversion[k] for k in ("calibration", "permutation")
                             if k in conversion}
    teacher = dense_teacher(prep.loaded.model, model) if conversion is not None else None
    assert prep.validation is not None
    probe = prep.validation.ids[:DIAGNOSE_WINDOWS]  # where the error sits (never the test)
    if teacher is not None:
        out["module_errors_changed"] = module_errors(model, teacher, probe)
    if arm.distills:
        assert teacher is not None and conversion is not None
        distill = dataclasses.replace(cfg.distill, seed=seed)
        torch.manual_seed(seed)
        out["distill_curve"] = finetune(
            model, prep.train_ids, validation_windows(prep, distill.eval_tokens), distill,
            progress, state_path=state_path.with_suffix(".distill.pt"), save_every=SAVE_EVERY,
            params=params, prefix=prep.window_prefix,
            objective=ModuleDistillation(teacher, conversion["modules"]))
        out["distill"] = dataclasses.asdict(distill)
        out["ppl_distilled"] = _ppl(model, prep)
    torch.manual_seed(seed)
    heal = dataclasses.replace(cfg.heal, seed=seed)
    out["curve"] = finetune(model, prep.train_ids, validation_windows(prep, heal.eval_tokens),
                            heal, progress, state_path=state_path, save_every=SAVE_EVERY,
                            params=params, prefix=prep.window_prefix)
    out["heal"] = dataclasses.asdict(heal)
    out["eval_healed"] = evaluate_all(model, prep.eval_ids, progress=False)  # per window
    out["ppl_healed"] = {k: v["ppl"] for k, v in out["eval_healed"].items()}
    steps = heal.steps + (cfg.distill.steps if arm.distills else 0)
    out["train_budget"] = {"heal_steps": heal.steps,
                           "distill_steps": cfg.distill.steps if arm.distills else 0,
                           "tokens": heal.steps * heal.batch_size * heal.seq_len
                           + (cfg.distill.steps * cfg.distill.batch_size * cfg.distill.seq_len
                              if arm.distills else 0),
                           "total_steps": steps}
    if teacher is not None:
        out["module_errors_healed"] = module_errors(model, teacher, probe)
    out["seconds"] = time.time() - t0
    return out


def _check_budget(arm: Arm, macs: float, prep: Prepared,
                  cfg: ConvertExperimentConfig) -> None:
    """A baseline's projection MACs within ``mac_tolerance`` below the algebra's,
    computed from the original model: ``original − (1 − rho) · target MACs``."""
    original = prep.loaded.model
    types = set(parse_types(arm.target))
    target = sum(site.module.weight.numel() for layer in get_adapter(original).layers
                 for site in layer.linear_sites() if types & set(site.types))
    rho = mac_ratio(AlgebraConfig(arm.budget, cfg.schedule, arm.target))
    budget = float(projection_macs(original) - (1 - rho) * target)
    dev = macs / budget - 1
    if not -cfg.mac_tolerance <= dev <= 1e-9:
        raise AssertionError(f"{arm.name} on {arm.target}: projection MACs {macs:,.0f} vs the "
                             f"{arm.budget} budget {budget:,.0f} ({dev:+.2%}; allowed "
                             f"−{cfg.mac_tolerance:.0%}..0)")


def _check_macs(arms: list[dict[str, Any]], tol: float) -> None:
    """Every algebra variant at one budget with the same projection MACs and parameters;
    every baseline within ``tol`` below its algebra arm's projection MACs."""
    ref: dict[tuple[str, str, int], float] = {}
    params: dict[tuple[str, str], int] = {}
    for a in arms:
        if a["kind"] != "algebra":
            continue
        key = (a["target"], a["budget"], a["seed"])
        if ref.setdefault(key, a["projection_macs"]) != a["projection_macs"] or params.setdefault(
                key[:2], a["projection_parameters"]) != a["projection_parameters"]:
            raise AssertionError(f"{a['arm']} on {a['target']}: projection MACs / parameters "
                                 f"{a['projection_macs']:,.0f} / {a['projection_parameters']:,}"
                                 f" differ from another variant's at the same budget")
    for a in arms:
        key = (a["target"], a["budget"], a["seed"])
        if a["kind"] in BASELINES and key in ref:
            dev = a["projection_macs"] / ref[key] - 1
            if not -tol <= dev <= 1e-9:
                raise AssertionError(f"{a['arm']} on {a['target']}: projection MACs "
                                     f"{a['projection_macs']:,.0f} vs the algebra's "
                                     f"{ref[key]:,.0f} ({dev:+.2%}; allowed −{tol:.0%}..0)")


def _check_plan(cfg: ConvertExperimentConfig) -> None:
    """Refuse a plan any of whose conversions cannot run on the model (widths not divisible
    by an algebra's q, a fused projection split, ...), from the architecture alone."""
    from structlm.convert import check_convertible
    from structlm.hf.loading import load_model

    arch = load_model(cfg.model, weights=False).model
    for arm in _arms(cfg):
        if arm.kind != "algebra":
            continue
        try:
            check_convertible(arch, arm.algebra_config(cfg.schedule))
        except (ValueError, ConfigError) as e:
            raise ConfigError(f"algebra {arm.budget!r} on target {arm.target!r} (variant "
                              f"{arm.variant}): {e}") from None
    check_baseline_budgets(arch, _arms(cfg), cfg.schedule, cfg.mac_tolerance)


def run_convert_experiment(cfg: ConvertExperimentConfig, out_dir: str | Path,
                           progress: bool = True, report_only: bool = False,
                           add_runs: list[str | Path] | tuple[str | Path, ...] = ()
                           ) -> dict[str, Any]:
    """Run every arm and seed (resuming from ``out_dir/arms.json``); writes
    ``results.json``, ``report.md`` and plots. Returns the results.

    ``add_runs``: other run folders of the same experiment (e.g. parts of the plan run by
    other processes or machines) whose finished runs in ``arms.json`` are added to this
    folder's first (a run finished in two folders must have the same record).
    ``report_only``: run nothing; rebuild the results and the report from the finished
    runs (the unfinished ones are left out of every table)."""
    t0 = time.time()
    out = Path(out_dir)
    check_apart(out, source_chain(cfg.model), "convert experiment folder")
    # every added folder is read before any work
    others = [read_finished_runs(f, "structlm experiment convert") for f in add_runs]
    _check_plan(cfg)  # every arm's conversion, before the first arm runs
    with run_folder_lock(out, "convert experiment"):  # one writer per run folder
        return _run_convert_experiment_locked(cfg, out, t0, progress, report_only, others)


def _run_convert_experiment_locked(cfg: ConvertExperimentConfig, out: Path, t0: float,
                                   progress: bool, report_only: bool = False,
                                   others: list[dict[str, Any]] | None = None
                                   ) -> dict[str, Any]:
    """The body of the run, under the run folder's lock."""
    from structlm.experiments.convert.report import write_convert_report

    atomic_write_text(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=1))
    arms_path = out / "arms.json"
    done: dict[str, Any] = json.loads(arms_path.read_text()) if arms_path.exists() else {}
    if merge_finished_runs(done, others or []):  # before any work
        atomic_write_text(arms_path, json.dumps(done))
    prep = prepare(cfg.model, cfg.corpus, cfg.second_corpus, calib_tokens=cfg.calib_tokens,
                   eval_tokens=cfg.eval_tokens, progress=progress)
    base = {"model": prep.loaded.model_id, "corpus": cfg.corpus,
            "second_corpus": cfg.second_corpus, "calib_tokens": cfg.calib_tokens,
            "eval_tokens": cfg.eval_tokens, "schedule": cfg.schedule,
            "heal": dataclasses.asdict(cfg.heal)}
    original = projection_macs(prep.loaded.model)
    res: dict[str, Any] = {
        "model": prep.loaded.model_id, "model_note": prep.loaded.note,
        "split": prep.split.describe(), "text": prep.text, "eval_texts": list(prep.eval_ids),
        "original": {"projection_macs": float(original),
                     "projection_parameters": projection_parameters(prep.loaded.model),
                     "ppl": _ppl(prep.loaded.model, prep)}}
    def key_of(arm: Arm, seed: int) -> str:
        distill = {"distill": dataclasses.asdict(cfg.distill)} if arm.distills else {}
        return json.dumps({**base, **dataclasses.asdict(arm), **distill, "seed": seed},
                          sort_keys=True)

    runs = [(arm, seed, key_of(arm, seed)) for arm, seed in planned_runs(cfg)]
    # results and report list the runs seed by seed in arm order, whatever order they ran in
    order = {key_of(arm, seed): i
             for i, (seed, arm) in enumerate(itertools.product(cfg.seeds, _arms(cfg)))}
    report_keys = sorted((key for _, _, key in runs), key=order.__getitem__)
    throttle = PlotThrottle()

    def write(final: bool = False) -> None:
        """Results and report from every planned run finished so far (in arm order)."""
        results = [done[key] for key in report_keys if key in done]
        _check_macs(results, cfg.mac_tolerance)
        res["arms"] = results
        res["seconds"] = time.time() - t0
        atomic_write_text(out / "results.json", json.dumps(clean_json(res), indent=1))
        write_convert_report(res, cfg, out, plots=throttle.due(final))

    write(final=report_only)
    if report_only:
        return res
    for arm, seed, key in runs:
        if key in done:
            continue
        if progress:
            print(f"[arm] {arm.name} on {arm.target}, seed {seed}", flush=True)
        state = out / "heal-state" / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".pt")
        done[key] = clean_json(_run_arm(arm, seed, prep, cfg, state, progress))
        atomic_write_text(arms_path, json.dumps(done))
        state.unlink(missing_ok=True)
        state.with_suffix(".distill.pt").unlink(missing_ok=True)
        write(final=all(k in done for _, _, k in runs))
    return res
