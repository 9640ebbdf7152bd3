"""``structlm experiment study`` configuration: arms trained on the same data, tokens, learning-rate
schedule and seeds, validated before any work starts.

An arm is a model variant: the FFN algebra, the FFN width (the preset's, a number,
``mac-match:<algebra>``: the dense width whose FFN MACs equal that algebra's at the
preset's width, or ``dense-macs``: the algebra FFN widened to the dense preset FFN's MACs),
the type schedule, structured scores, the initialisation and the learning rate (the
study's, a number, ``sweep``: the best rate of the study's ``lr_sweep``, or
``from:<arm>``: another arm's). Every arm shares the rest of the ``train`` block (batch,
context, schedule shape, optimiser); ``budgets`` lists training lengths in steps, and
every arm trains at each of its budgets from scratch, so the runs of one budget see the
same tokens. The checks run at load:

* arm names are distinct, and so are the arms' models;
* every algebra arm's schedule gives every type a position in a training window;
* equal-parameter arms (the preset's FFN width) have exactly the dense reference's
  parameter count; ``mac-match`` arms have exactly the matched algebra's FFN MACs;
  ``dense-macs`` arms are within 0.5% of the dense reference's FFN MACs (the width is
  rounded to a multiple of ``q``) and have more parameters;
* learning rates resolve (``sweep`` needs an ``lr_sweep``, ``from:`` a known arm, no
  cycles) and the sweep's budget is one of the budgets;
* the FFN carries at least half of the non-embedding forward MACs per token.

The protocol (:data:`PROTOCOL`): the text is split three ways by document (train,
validation, test; every corpus part has validation and test documents); every decision —
the learning-rate sweep's choice (:func:`choose_rate`) — reads the validation record of a
run's ``final.json`` and refuses anything else; the test text is scored once per finished
run, and only the report's verdicts read it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any

from structlm.config import ConfigError, Distinct, NonEmpty, OneOf, Range, validated
from structlm.hf.splits import Role, TestWindowsError
from structlm.models.presets import PRESETS
from structlm.train.loop import TrainConfig

__all__ = ["PROTOCOL", "ArmSpec", "LrSweep", "OldProtocolError", "Run", "StudyConfig",
           "choose_rate", "chosen_rates", "load_study_config", "run_summary",
           "validation_record"]

PROTOCOL = 2
"""The study protocol a folder was run under (``study_config.json``'s ``protocol``).
1 (no key): train / validation split, the sweep and the verdicts both on validation, seed
ranges. 2: train / validation / test split, decisions on validation, verdicts on the test
text through :mod:`structlm.stats`."""


class OldProtocolError(ValueError):
    """A study folder (or a run's ``final.json``) written under an older protocol."""

_SHARED_TRAIN_FIELDS = ("seq_len", "batch_size", "grad_accum", "max_steps", "lr",
                        "warmup_steps", "min_lr_ratio", "weight_decay", "beta1", "beta2",
                        "grad_clip", "eval_every", "eval_batches", "save_every", "threads",
                        "val_fraction")


@dataclass(frozen=True)
@validated
class ArmSpec:
    """One arm of a study."""

    name: Annotated[str, NonEmpty()]
    """The arm's name (its runs' folder: no ``/``, no surrounding spaces)."""
    algebra: Annotated[str, NonEmpty()] = "dense"
    ffn: str | int = "preset"
    """``preset`` (the preset's width), an integer width >= 1, or ``mac-match:<algebra>``."""
    type_schedule: Annotated[str, NonEmpty()] = "auto"
    structured_scores: bool = False
    seeds: Annotated[tuple[Annotated[int, Range(ge=0)], ...], NonEmpty(), Distinct()] = (0,)
    lr: float | str | None = None
    """``None`` (the study's ``train.lr``), a rate > 0, ``sweep`` (the lowest-loss rate of
    the study's ``lr_sweep``) or ``from:<arm>`` (that arm's rate)."""
    init: Annotated[str, OneOf("dense", "variance-matched")] = "dense"
    """The model's ``algebra_init`` (see :class:`~structlm.models.StructLMConfig`)."""
    budgets: Annotated[tuple[Annotated[int, Range(ge=1)], ...] | None, Distinct()] = None
    """Training lengths (steps) this arm runs at: a subset of the study's ``budgets``;
    ``None``: all of them."""

    def __post_init__(self) -> None:
        """Cross-field checks (each field's own range is checked by ``@validated``)."""
        if "/" in self.name or self.name != self.name.strip():
            raise ConfigError(f"arm name {self.name!r} must be without '/' or surrounding "
                              "spaces")
        if isinstance(self.ffn, int) and self.ffn < 1:
            raise ConfigError(f"arm {self.name!r}: ffn width {self.ffn} must be >= 1")
        if isinstance(self.ffn, str) and self.ffn not in ("preset", "dense-macs") and not (
                self.ffn.startswith("mac-match:")):
            raise ConfigError(f"arm {self.name!r}: ffn {self.ffn!r} must be 'preset', an "
                              "integer width, 'mac-match:<algebra>' or 'dense-macs'")
        if isinstance(self.lr, float | int) and not isinstance(self.lr, bool):
            if not self.lr > 0:
                raise ConfigError(f"arm {self.name!r}: lr {self.lr!r} must be > 0")
        elif self.lr is not None and (not isinstance(self.lr, str) or not (
                self.lr == "sweep" or self.lr.startswith("from:"))):
            raise ConfigError(f"arm {self.name!r}: lr {self.lr!r} must be a rate > 0, "
                              "'sweep' or 'from:<arm>'")

    @property
    def is_dense(self) -> bool:
        """Whether the FFN is dense."""
        from structlm.algebra import is_dense

        return is_dense(self.algebra)


@dataclass(frozen=True)
@validated
class LrSweep:
    """A learning-rate sweep: every arm with ``lr: sweep`` trains at each rate for one
    budget and one seed; the rate with the lowest whole-split validation loss is its
    rate for every budget and seed (:func:`choose_rate`)."""

    rates: Annotated[tuple[Annotated[float, Range(gt=0)], ...], NonEmpty(), Distinct()]
    budget: Annotated[int, Range(ge=1)]
    """Training steps of the sweep runs: one of the study's ``budgets``."""
    seed: Annotated[int, Range(ge=0)] = 0
    reuse: bool = True
    """``True``: the sweep's seed is one of each swept arm's seeds, and the sweep run at
    the chosen rate is reused as the arm's run at that budget and seed. ``False``: the
    seed is none of them, so every run of the verdicts is a fresh draw — the chosen run
    was picked for its low validation loss, and the luck of its seed (initialisation,
    batch order) that helped it there helps it on the test text too."""


@dataclass(frozen=True)
class Run:
    """One training run of a study: an arm at a budget (steps), a rate and a seed."""

    arm: ArmSpec
    steps: int
    lr: float
    seed: int
    sweep: bool = False
    """A run of the learning-rate sweep (it may also be a main run: the chosen rate's)."""


@dataclass(frozen=True)
@validated
class StudyConfig:
    """A study: the shared data and training settings, and the arms."""

    out_dir: Annotated[str, NonEmpty()]
    arms: Annotated[tuple[ArmSpec, ...], NonEmpty()]
    preset: Annotated[str, OneOf(*PRESETS)] = "study-cpu"
    corpus: Annotated[str, NonEmpty()] = "shakespeare"
    tokenizer: Annotated[str, NonEmpty()] = "bpe:8192"
    data_seed: Annotated[int, Range(ge=0)] = 0
    train: dict[str, Any] = field(default_factory=dict)
    min_val_tokens: Annotated[int, Range(ge=0)] = 100_000
    eval_batch_size: Annotated[int, Range(ge=1)] = 8
    generation_tokens: Annotated[int, Range(ge=1)] = 128
    generation_runs: Annotated[int, Range(ge=2, note="the first run is a warm-up")] = 4
    budgets: Annotated[tuple[Annotated[int, Range(ge=1)], ...], Distinct()] = ()
    """Training lengths in steps (tokens = steps x batch x seq_len); empty: the one
    ``train.max_steps``."""
    lr_sweep: LrSweep | None = None
    notes: tuple[str, ...] = ()
    """Lines the report prints under "Scope" (e.g. a question left out and why); they may
    change while the study runs."""

    def __post_init__(self) -> None:
        """Cross-field checks (each field's own range is checked by ``@validated``)."""
        bad = sorted(set(self.train) - set(_SHARED_TRAIN_FIELDS))
        if bad:
            raise ValueError(f"train: keys {bad} cannot be set for the whole study; expected "
                             f"some of {list(_SHARED_TRAIN_FIELDS)} (the model and seed are "
                             "per arm)")
        if self.budgets and "max_steps" in self.train:
            raise ValueError(f"train.max_steps={self.train['max_steps']} and budgets="
                             f"{list(self.budgets)} both set the training length: keep one")
        names = [a.name for a in self.arms]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"arm names {dup} are used twice")
        self._check_rates()
        models: dict[tuple[Any, ...], str] = {}
        for arm in self.arms:
            extra = sorted(set(arm.budgets or ()) - set(self.all_budgets()))
            if extra:
                raise ValueError(f"arm {arm.name!r}: budgets {extra} are not among the "
                                 f"study's budgets {list(self.all_budgets())}")
            key = (arm.algebra.strip().lower(), self.ffn_width(arm),
                   self.run_config(arm, arm.seeds[0]).model_schedule() if not arm.is_dense
                   else "", arm.structured_scores, arm.init if not arm.is_dense else "dense",
                   repr(arm.lr))
            if key in models:
                raise ValueError(f"arms {models[key]!r} and {arm.name!r} train the same model")
            models[key] = arm.name
        self._check_budgets()

    # ---------------------------------------------------------------- per arm
    def all_budgets(self) -> tuple[int, ...]:
        """The study's training lengths in steps, ascending."""
        if self.budgets:
            return tuple(sorted(self.budgets))
        return (int(self.train.get("max_steps", TrainConfig.max_steps)),)

    def arm_budgets(self, arm: ArmSpec) -> tuple[int, ...]:
        """The budgets (steps) ``arm`` runs at, ascending."""
        return tuple(sorted(arm.budgets)) if arm.budgets else self.all_budgets()

    @property
    def legacy_layout(self) -> bool:
        """One budget and one rate per arm: runs live in ``runs/<arm>/seed<k>``."""
        return not self.budgets and self.lr_sweep is None

    def ffn_width(self, arm: ArmSpec) -> int:
        """The arm's FFN width ``F``."""
        base = int(PRESETS[self.preset]["intermediate_size"])
        if arm.ffn == "preset":
            return base
        if isinstance(arm.ffn, int):
            return arm.ffn
        from structlm.algebra import num_types
        from structlm.models.cost import _rho
        from structlm.models.presets import config_from_preset

        if arm.ffn == "dense-macs":
            q = num_types(arm.algebra)
            exact = Fraction(base) / _rho(config_from_preset(self.preset, arm.algebra))
            return max(q, round(exact / q) * q)
        target = arm.ffn.split(":", 1)[1]
        width = Fraction(base) * _rho(config_from_preset(self.preset, target))
        if width.denominator != 1:
            raise ValueError(f"arm {arm.name!r}: {arm.ffn} needs FFN width {base} x rho = "
                             f"{width}, not an integer")
        return int(width)

    def run_config(self, arm: ArmSpec, seed: int, steps: int | None = None,
                   lr: float | None = None) -> TrainConfig:
        """The :class:`TrainConfig` of one run (``arm``, ``seed``; ``steps`` defaults to
        the arm's first budget, ``lr`` to a fixed rate of the arm or the study's)."""
        overrides: dict[str, Any] = {"intermediate_size": self.ffn_width(arm)}
        if arm.structured_scores:
            overrides["structured_scores"] = True
        if arm.init != "dense":
            overrides["algebra_init"] = arm.init
        steps = self.arm_budgets(arm)[0] if steps is None else steps
        if lr is None:
            lr = self.fixed_lr(arm)
        train = {**self.train, "max_steps": steps}
        if lr is not None:
            train["lr"] = lr
        folder = (f"{arm.name}/seed{seed}" if self.legacy_layout
                  else f"{arm.name}/steps{steps}-lr{train.get('lr', TrainConfig.lr):g}/seed{seed}")
        return TrainConfig(out_dir=f"{self.out_dir}/runs/{folder}",
                           data_dir=f"{self.out_dir}/data", preset=self.preset,
                           algebra=arm.algebra, type_schedule=arm.type_schedule,
                           model_overrides=overrides, corpus=self.corpus,
                           tokenizer=self.tokenizer, data_seed=self.data_seed, seed=seed,
                           test_split=True, **train)

    def run_config_of(self, run: Run) -> TrainConfig:
        """The :class:`TrainConfig` of ``run``."""
        return self.run_config(run.arm, run.seed, run.steps, run.lr)

    def arm(self, name: str) -> ArmSpec:
        """The arm called ``name``."""
        for a in self.arms:
            if a.name == name:
                return a
        raise KeyError(name)

    def fixed_lr(self, arm: ArmSpec) -> float | None:
        """The arm's rate when it does not depend on the sweep (``None`` when it does)."""
        seen = set()
        while isinstance(arm.lr, str) and arm.lr.startswith("from:") and arm.name not in seen:
            seen.add(arm.name)
            arm = self.arm(arm.lr[5:])
        if arm.lr is None:
            return float(self.train.get("lr", TrainConfig.lr))
        return None if isinstance(arm.lr, str) else float(arm.lr)

    def swept_arm(self, arm: ArmSpec) -> ArmSpec | None:
        """The arm whose sweep decides ``arm``'s rate (itself, or the end of its
        ``from:`` chain), or ``None`` for a fixed rate."""
        while isinstance(arm.lr, str) and arm.lr.startswith("from:"):
            arm = self.arm(arm.lr[5:])
        return arm if arm.lr == "sweep" else None

    def sweep_runs(self) -> list[Run]:
        """The learning-rate sweep's runs (arms in order, rates ascending)."""
        if self.lr_sweep is None:
            return []
        sw = self.lr_sweep
        return [Run(a, sw.budget, float(r), sw.seed, sweep=True) for a in self.arms
                if a.lr == "sweep" for r in sorted(sw.rates)]

    def main_runs(self, rates: dict[str, float | None]) -> list[Run]:
        """Every (arm, budget, seed) at the arm's rate (``rates[arm]`` for swept arms:
        ``None`` while the sweep is unfinished, then the run is left out): budgets
        ascending; within one, the first seed of every arm, then the further seeds."""
        order: list[Run] = []
        for steps in self.all_budgets():
            arms = [a for a in self.arms if steps in self.arm_budgets(a)]
            depth = max((len(a.seeds) for a in arms), default=0)
            for k in range(depth):
                for a in arms:
                    if len(a.seeds) <= k:
                        continue
                    lr = self.fixed_lr(a)
                    if lr is None:
                        lr = rates.get(self.swept_arm(a).name)  # type: ignore[union-attr]
                    if lr is not None:
                        order.append(Run(a, steps, lr, a.seeds[k]))
        return order

    def runs(self) -> list[tuple[ArmSpec, int]]:
        """Every (arm, seed) of a one-budget study without a sweep, first seeds of every
        arm first (so one seed of each arm exists early), then the further seeds."""
        return [(r.arm, r.seed) for r in self.main_runs({})]

    def model_config(self, arm: ArmSpec) -> Any:
        """The arm's model config (the preset's vocabulary: for the budget accounting)."""
        return self.run_config(arm, arm.seeds[0], lr=1.0).model_config()

    # ---------------------------------------------------------------- checks
    def _check_rates(self) -> None:
        names = {a.name for a in self.arms}
        for arm in self.arms:
            chain = [arm.name]
            a = arm
            while isinstance(a.lr, str) and a.lr.startswith("from:"):
                src = a.lr[5:]
                if src not in names:
                    raise ValueError(f"arm {a.name!r}: lr {a.lr!r} names no arm; arms are "
                                     f"{sorted(names)}")
                if src in chain:
                    raise ValueError(f"arm {arm.name!r}: lr 'from:' chain {[*chain, src]} is "
                                     "a cycle")
                chain.append(src)
                a = self.arm(src)
            if a.lr == "sweep" and self.lr_sweep is None:
                raise ValueError(f"arm {a.name!r} has lr: sweep but the study has no lr_sweep")
        if self.lr_sweep is not None:
            if not any(a.lr == "sweep" for a in self.arms):
                raise ValueError("lr_sweep is set but no arm has lr: sweep")
            if self.lr_sweep.budget not in self.all_budgets():
                raise ValueError(f"lr_sweep.budget={self.lr_sweep.budget} is not among the "
                                 f"budgets {list(self.all_budgets())}")
            for a in self.arms:
                if a.lr == "sweep" and self.lr_sweep.budget not in self.arm_budgets(a):
                    raise ValueError(f"arm {a.name!r} is swept at {self.lr_sweep.budget} "
                                     f"steps but runs only at {list(self.arm_budgets(a))}")
                if a.lr == "sweep" and self.lr_sweep.reuse and self.lr_sweep.seed not in a.seeds:
                    raise ValueError(f"arm {a.name!r}: the sweep's seed {self.lr_sweep.seed} "
                                     f"is not among its seeds {list(a.seeds)} (reuse: true "
                                     "reuses the chosen rate's sweep run as that seed's run)")
                if a.lr == "sweep" and not self.lr_sweep.reuse and self.lr_sweep.seed in a.seeds:
                    raise ValueError(f"arm {a.name!r}: the sweep's seed {self.lr_sweep.seed} "
                                     f"is one of its seeds {list(a.seeds)}, but reuse: false "
                                     "keeps the sweep's runs out of the verdicts: give the "
                                     "sweep a seed of its own")

    def _check_budgets(self) -> None:
        from structlm.models.cost import model_cost, parameter_count

        dense = model_cost(self.model_config(ArmSpec("preset")))["training_macs_per_token"]
        non_emb = sum(dense[k]["dense"] for k in ("attention_projections", "attention_scores",
                                                  "ffn"))
        if 2 * dense["ffn"]["dense"] < non_emb:
            raise ValueError(f"preset {self.preset!r}: the dense FFN carries "
                             f"{dense['ffn']['dense'] / non_emb:.0%} of the non-embedding MACs, "
                             "under half: the comparison would not be about the FFN")
        ref = next((a for a in self.arms if a.is_dense and a.ffn == "preset"), None)
        ref_params = parameter_count(self.model_config(ref)) if ref else None
        for arm in self.arms:
            cfg = self.model_config(arm)
            cost = model_cost(cfg)["training_macs_per_token"]
            if arm.ffn == "preset" and ref_params is not None:
                if parameter_count(cfg) != ref_params:
                    raise ValueError(f"arm {arm.name!r} has {parameter_count(cfg):,} parameters, "
                                     f"the dense reference {ref_params:,}")
            if isinstance(arm.ffn, str) and arm.ffn.startswith("mac-match:"):
                target = self.model_config(dataclasses.replace(arm, algebra=arm.ffn[10:],
                                                               ffn="preset", init="dense"))
                want = model_cost(target)["training_macs_per_token"]["ffn"]["algebra"]
                if cost["ffn"]["algebra"] != want:
                    raise ValueError(f"arm {arm.name!r}: FFN MACs {cost['ffn']['algebra']:,} "
                                     f"differ from {arm.ffn[10:]}'s {want:,}")
            if arm.ffn == "dense-macs":
                if arm.is_dense:
                    raise ValueError(f"arm {arm.name!r}: ffn 'dense-macs' widens an algebra "
                                     "FFN to the dense FFN's MACs; a dense arm is that already")
                want = dense["ffn"]["dense"]
                if abs(cost["ffn"]["algebra"] - want) > 0.005 * want:
                    raise ValueError(f"arm {arm.name!r}: FFN MACs {cost['ffn']['algebra']:,} "
                                     f"are more than 0.5% from the dense FFN's {want:,}")
                if ref_params is not None and parameter_count(cfg) <= ref_params:
                    raise ValueError(f"arm {arm.name!r}: {parameter_count(cfg):,} parameters, "
                                     f"not more than the dense reference's {ref_params:,}")


def load_study_config(path: str, **overrides: Any) -> StudyConfig:
    """A :class:`StudyConfig` from YAML; unknown keys are an error naming them.
    ``overrides`` (``None`` values ignored): ``out_dir``, ``max_steps``, ``threads``."""
    from structlm.config import ConfigError, dataclass_from_dict, read_yaml

    raw = read_yaml(path)
    if overrides.get("out_dir"):
        raw["out_dir"] = overrides["out_dir"]
    for key in ("max_steps", "threads"):
        if overrides.get(key) is not None:
            raw["train"] = {**(raw.get("train") or {}), key: overrides[key]}
    if "out_dir" not in raw:
        raise ConfigError(f"{path}: out_dir is required")
    arms = []
    for i, a in enumerate(raw.get("arms") or []):
        if not isinstance(a, dict) or "name" not in a:
            raise ConfigError(f"{path}: arms[{i}] must be a mapping with a name")
        arms.append(dataclass_from_dict(ArmSpec, a, where=f"{path}: arms[{i}] ({a['name']})"))
    if raw.get("lr_sweep") is not None:
        if not isinstance(raw["lr_sweep"], dict):
            raise ConfigError(f"{path}: lr_sweep must be a mapping (rates, budget, seed)")
        raw["lr_sweep"] = dataclass_from_dict(LrSweep, raw["lr_sweep"], where=f"{path}: lr_sweep")
    return dataclass_from_dict(StudyConfig, {**raw, "arms": arms}, where=path)


def run_summary(cfg: StudyConfig, arm: ArmSpec | Run, seed: int | None = None
                ) -> dict[str, Any] | None:
    """The finished run's ``final.json`` (a :class:`Run`, or an arm and seed of a
    one-budget study without a sweep), or ``None``."""
    rc = cfg.run_config_of(arm) if isinstance(arm, Run) else cfg.run_config(arm, seed or 0)
    path = Path(rc.out_dir) / "final.json"
    return json.loads(path.read_text()) if path.exists() else None


def validation_record(summary: Mapping[str, Any], where: str = "a run") -> dict[str, Any]:
    """The validation record of a finished run's ``final.json`` (``role: validation``,
    ``loss``, ``tokens``, ``windows``, ``parts``): what decisions read. A ``final.json``
    without one was written under protocol 1: :class:`OldProtocolError`."""
    rec = summary.get("validation")
    if not isinstance(rec, Mapping):
        raise OldProtocolError(f"{where}: its final.json has no validation record (written "
                               f"under study protocol 1, before the test split): it takes "
                               f"part in no protocol-{PROTOCOL} decision")
    return dict(rec)


def choose_rate(records: Mapping[float, Mapping[str, Any]],
                who: str = "the learning-rate sweep") -> float:
    """The rate whose validation loss is lowest (ties: the smaller rate). Every record must
    be a validation record (``role: validation``, from :func:`validation_record`); a test
    record, per-window test scores, or a record of unknown role raises
    :class:`~structlm.hf.splits.TestWindowsError`: the choice never reads the test text."""
    if not records:
        raise ValueError(f"{who}: no finished run to choose from")
    for lr, rec in records.items():
        role = rec.get("role") if isinstance(rec, Mapping) else None
        if role != Role.VALIDATION.value:
            raise TestWindowsError(f"{who} decides from validation records only, got "
                                   f"{'the ' + str(role) if role else 'a record of unknown'} "
                                   f"role at lr {lr:g}: decisions never read the test text")
    return min((float(rec["loss"]), float(lr)) for lr, rec in records.items())[1]


def chosen_rates(cfg: StudyConfig) -> dict[str, float | None]:
    """Per swept arm, the sweep's rate with the lowest whole-split validation loss
    (:func:`choose_rate`; ties: the smaller rate), ``None`` until every sweep run of that
    arm has finished."""
    out: dict[str, float | None] = {}
    for arm in (a for a in cfg.arms if a.lr == "sweep"):
        mine = [r for r in cfg.sweep_runs() if r.arm.name == arm.name]
        done = {r.lr: run_summary(cfg, r) for r in mine}
        if any(s is None for s in done.values()):
            out[arm.name] = None
            continue
        out[arm.name] = choose_rate(
            {lr: validation_record(s, f"{arm.name} lr {lr:g}")  # type: ignore[arg-type]
             for lr, s in done.items()}, f"the learning-rate sweep of {arm.name!r}")
    return out
