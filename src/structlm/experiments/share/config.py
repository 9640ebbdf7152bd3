"""The config of ``structlm experiment share`` (one typed layer, checked at load)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any

from structlm.config import ConfigError, Distinct, NonEmpty, Range, dataclass_from_dict, validated
from structlm.experiments.share.beside import check_beside_folder
from structlm.hf.adapters import parse_types
from structlm.hf.finetune import FinetuneConfig
from structlm.share.compress import METHODS
from structlm.share.compress.methods import (
    BASIS_SHARING_METHOD,
    CONTROL_METHODS,
    SHARED_METHOD,
    SVD_LLM_W_METHOD,
    canonical_name,
)

__all__ = ["ExperimentConfig"]


def _long_finetune() -> FinetuneConfig:
    return FinetuneConfig(steps=300, warmup=15, eval_every=50)


def _control_finetune() -> FinetuneConfig:
    return FinetuneConfig(steps=300, lr=1e-3, lr_scaling="absolute", warmup=15,
                          min_lr_ratio=1.0, eval_every=25, keep_best=True)


def _whole_finetune() -> FinetuneConfig:
    return FinetuneConfig(steps=100, warmup=5, eval_every=25)


_FRACTION = Annotated[float, Range(gt=0, lt=1)]


@dataclass
@validated
class ExperimentConfig:
    """Budgets of the experiment (SmolLM2 on 2 cores: several hours with the defaults;
    every finished arm is kept in ``arms.json``, so an interrupted run resumes)."""

    model: Annotated[str, NonEmpty()] = "smollm2"
    corpus: Annotated[str, NonEmpty()] = "austen"
    """Calibration and fine-tuning corpus; its held-out documents are the in-domain text."""
    second_corpus: str = "shakespeare"
    """Other-domain evaluation text."""
    calib_tokens: Annotated[int, Range(ge=512, note="one calibration window")] = 32768
    """Calibration tokens (windows across all calibration documents, seeded)."""
    eval_tokens: Annotated[int, Range(ge=2)] = 16384
    """Scored tokens per evaluation text (windows drawn across all held-out documents)."""
    methods: Annotated[list[str], NonEmpty(), Distinct()] = field(
        default_factory=lambda: [m for m in METHODS if m not in CONTROL_METHODS])
    """Methods of the whole-model regime (see share/compress/ranks.py)."""
    reductions: Annotated[list[_FRACTION], NonEmpty(), Distinct()] = field(
        default_factory=lambda: [0.2, 0.3, 0.4, 0.5])
    """Whole-model regime: fraction of every compressed type's parameters removed."""
    types: Annotated[str, NonEmpty()] = "all"
    """Matrix types of the whole-model regime."""
    seeds: Annotated[list[Annotated[int, Range(ge=0)]], NonEmpty(), Distinct()] = field(
        default_factory=lambda: [0, 1, 2])
    """Fine-tuning seeds."""
    multi_seed_reductions: Annotated[list[_FRACTION], Distinct()] = field(
        default_factory=lambda: [0.2, 0.4])
    """Reductions fine-tuned with every seed; the others with ``seeds[0]`` only."""
    calib_seeds: Annotated[list[Annotated[int, Range(ge=0)]], NonEmpty(), Distinct()] = field(
        default_factory=lambda: [0])
    """Calibration draws (seeded windows from the same calibration documents): the
    whole-model regime runs at each, draw ``k`` with the fine-tuning seeds shifted by
    ``k × (max(seeds) + 1)`` (seeds ``[0]``, draws ``[0, 1]``: draw 0 with seed 0, draw 1
    with seed 1), so its ranges span both sources of variance; the seed regime, the
    scope arms and the evaluation windows use the first."""
    finetune_methods: Annotated[list[str] | None, Distinct()] = None
    """Whole-model methods that are fine-tuned (``None``: every method); the others are
    compressed and evaluated only."""
    finetune_lr: dict[str, Annotated[float, Range(gt=0)]] = field(default_factory=dict)
    """Per-method learning rate of the whole-model fine-tuning (``{"shared": 1e-3}``),
    replacing ``finetune.lr`` for that method (e.g. each method at the rate a probe chose
    for it); methods not named use ``finetune.lr``, and a named method the run leaves out
    of ``methods`` is ignored (one config split across processes by ``--methods``)."""
    residual_rank: Annotated[int, Range(ge=0)] = 32
    """Rank of the hybrid's per-layer residual."""
    group_size: Annotated[int, Range(ge=1)] = 2
    """``basis-sharing``: consecutive layers per basis (the paper's LLaMA configs: 2)."""
    update: bool = False
    """``basis-sharing``: the paper's optional closed-form update step."""
    finetune: FinetuneConfig = field(default_factory=_whole_finetune)
    """Fine-tuning of every whole-model and scope arm (the same for every method)."""
    seed_finetune: FinetuneConfig = field(default_factory=_long_finetune)
    """Fine-tuning of the seed regime's arms (long enough to plateau: ≥ 300 steps)."""
    seed_regime: bool = True
    """Run the seed's regime (Q only at k = d/4 and equal-storage baselines)."""
    seed_types: Annotated[str, NonEmpty()] = "q"
    """Matrix types of the seed regime."""
    seed_k_fraction: Annotated[float, Range(gt=0, le=1)] = 0.25
    """The seed regime's k as a fraction of the hidden size (the seed's d/4)."""
    seed_methods: Annotated[list[str], Distinct()] = field(default_factory=lambda: [
        SHARED_METHOD.name, SVD_LLM_W_METHOD.name, BASIS_SHARING_METHOD.name])
    """Methods of the seed regime, ``shared`` first (it sets the storage of the others)."""
    seed_lr_probe_rates: Annotated[list[Annotated[float, Range(gt=0)]], Distinct()] = field(
        default_factory=list)
    """Learning-rate probe of the seed regime (empty: none): each of ``seed_methods`` at
    every rate, ``seed_finetune`` cut to ``lr_probe_steps``, the first seed; its runs use
    the rate with the lowest best validation NLL."""
    seed_control_methods: Annotated[list[str], Distinct()] = field(default_factory=list)
    """Test 6 as the seed states it (empty: not run): these methods in the seed regime
    (e.g. ``[shared, lowrank-random, lowrank-svd]``: the shared basis against per-layer
    ``B_l C_l`` from a random and a plain-SVD start at its storage), every one fine-tuned
    with ``seed_control_finetune`` — plain AdamW at an absolute rate, the seed's "identical
    training" — beside the stronger control of ``seed_methods`` (relative rates)."""
    seed_control_finetune: FinetuneConfig = field(default_factory=_control_finetune)
    """Fine-tuning of ``seed_control_methods`` (absolute rate, the same for all of them
    unless ``seed_control_lr_probe_rates`` chooses one per method)."""
    seed_control_lr_probe_rates: Annotated[list[Annotated[float, Range(gt=0)]],
                                           Distinct()] = field(default_factory=list)
    """Learning-rate probe of ``seed_control_methods`` (as ``seed_lr_probe_rates``)."""
    whole_model: bool = True
    """Run the whole-model regime (false: only the seed regime, its controls and the
    scope arms)."""
    scope: bool = True
    """Run tests 7/9: attention only vs MLP only at scope_reduction."""
    scope_reduction: _FRACTION = 0.4
    """Reduction of every type for tests 7 and 9."""
    budget_tolerance: Annotated[float, Range(ge=0, lt=1)] = 0.005
    """Whole-model arms must store within this fraction of the budget."""
    plateau_window: Annotated[int, Range(ge=1, le=20)] = 1
    """The plateau rule compares the mean held-out perplexity of a run's last this many
    evaluations with the mean of the this many before (1: the last two evaluations; a
    noisy subset needs more to separate a plateau from noise)."""
    keep_finetune_states: bool = False
    """Keep each finished fine-tuning run's final state (trained tensors, optimiser, batch
    generator, curve) in ``finetune-final/<hash of its key>.pt`` beside ``arms.json``
    instead of deleting it when the arm is recorded, so a run can later be taken past its
    step count without being redone (SmolLM2-135M: ~0.8 GB per run, Qwen2.5-Coder-0.5B:
    ~2.6 GB). Not part of any arm's key."""
    continue_unplateaued_to: Annotated[int | None, Range(ge=1)] = None
    """When any whole-model fine-tuning run of this experiment has not plateaued on its
    validation curve at ``finetune.steps`` (the plateau rule, ``plateau_window``), *every*
    whole-model run is continued to this many steps (so compared arms keep equal budgets)
    — from the final state ``keep_finetune_states`` kept, or, where none was kept, from
    step 0 (the same run) — once every planned run is done; the report uses the continued
    runs. Runs split over processes decide apart: the report then refuses verdicts between
    unequal budgets. Needs a constant rate after warm-up; ``None``: no continuation."""
    methods_at: dict[_FRACTION, Annotated[list[str], NonEmpty(), Distinct()]] = field(
        default_factory=dict)
    """Per reduction, the methods of the whole-model regime there (those of ``methods``
    it names; e.g. ``{0.3: [basis-sharing]}`` for an equal-compute partner); a reduction
    not named runs every method."""
    draw_reductions: Annotated[list[_FRACTION] | None, Distinct()] = None
    """The reductions run on the calibration draws after the first (``None``: every
    reduction)."""
    lr_probe_rates: Annotated[list[Annotated[float, Range(gt=0)]], Distinct()] = field(
        default_factory=list)
    """Learning-rate probe (empty: none): before the whole-model runs, every fine-tuned
    method is fine-tuned at each of these rates (at ``lr_probe_reduction``, the first seed
    and calibration draw, ``lr_probe_steps`` steps, best validation checkpoint), and its
    whole-model runs use the rate whose best validation NLL is lowest (decided on the
    validation text only; the report shows the probe)."""
    lr_probe_steps: Annotated[int, Range(ge=1)] = 300
    """Steps of each probe run."""
    lr_probe_reduction: _FRACTION | None = None
    """The reduction the probe runs at (``None``: the largest of ``reductions``; it need not
    be one of them, so that processes split by ``--reductions`` share one probe)."""
    val_tokens: Annotated[int, Range(ge=512)] = 8192
    """Validation tokens drawn across the calibration documents' held-out tails (what
    every fine-tuning curve and decision reads; ``finetune.eval_tokens`` of them, evenly
    spread, are scored at each evaluation)."""
    beside: str | None = None
    """An earlier ``structlm experiment share`` folder on the same model and text whose
    whole-model fine-tuned numbers the report shows beside this run's (e.g. the committed
    100-step run beside a longer one); ``None``: none."""

    def __post_init__(self) -> None:
        """Cross-field checks (each field's own range is checked by ``@validated``);
        deprecated method names (``svd``) resolve to their methods, with a warning."""
        self.methods = [canonical_name(m) for m in self.methods]
        self.seed_methods = [canonical_name(m) for m in self.seed_methods]
        self.seed_control_methods = [canonical_name(m) for m in self.seed_control_methods]
        if self.finetune_methods is not None:
            self.finetune_methods = [canonical_name(m) for m in self.finetune_methods]
        self.finetune_lr = {canonical_name(m): v for m, v in self.finetune_lr.items()}
        self.methods_at = {r: [canonical_name(m) for m in ms]
                           for r, ms in self.methods_at.items()}
        for key in ("finetune", "seed_finetune", "seed_control_finetune"):
            if not isinstance(getattr(self, key), FinetuneConfig):
                raise ConfigError(f"{key}: {getattr(self, key)!r} is not a mapping of "
                                  "FinetuneConfig keys")
        if self.keep_finetune_states:  # kept to be continued: the schedule must allow it
            for key in ("finetune", *(("seed_finetune",) if self.seed_regime else ())):
                ft = getattr(self, key)
                if ft.min_lr_ratio != 1.0 and ft.warmup < ft.steps:
                    raise ConfigError(
                        f"keep_finetune_states keeps finished runs' states to continue them, "
                        f"which needs a constant rate after warm-up; {key}.min_lr_ratio is "
                        f"{ft.min_lr_ratio} (a cosine that depends on the run's length): set "
                        f"it to 1.0 or keep_finetune_states to false")
        if self.continue_unplateaued_to is not None:
            ft = self.finetune
            if self.continue_unplateaued_to <= ft.steps:
                raise ConfigError(f"continue_unplateaued_to={self.continue_unplateaued_to} "
                                  f"must exceed finetune.steps={ft.steps}")
            if ft.min_lr_ratio != 1.0:
                raise ConfigError(f"continue_unplateaued_to needs a constant rate after "
                                  f"warm-up (finetune.min_lr_ratio 1.0), got "
                                  f"{ft.min_lr_ratio}: a cosine depends on the run's length")
        both = sorted(set(self.finetune_lr) & set(self.methods)) if self.lr_probe_rates else []
        if both:
            raise ConfigError(f"finetune_lr names {both} and lr_probe_rates would choose their "
                              "rate: set one of the two")
        for red, ms in self.methods_at.items():
            if not isinstance(red, float | int) or not 0 < red < 1:
                raise ConfigError(f"methods_at: the key {red!r} is not a reduction in (0, 1)")
            bad = [m for m in ms if m not in METHODS]
            if bad:
                raise ConfigError(f"methods_at[{red}]: unknown methods {bad}: expected some "
                                  f"of {tuple(METHODS)}")
        if self.finetune_methods is not None:
            bad = [m for m in self.finetune_methods if m not in self.methods]
            if bad:
                raise ConfigError(f"finetune_methods: {bad} are not among methods "
                                  f"{self.methods}")
        # a rate for a known method this run leaves out is kept (a config split by
        # methods across processes); an unknown name is a typo
        bad_lr = [m for m in self.finetune_lr if m not in METHODS]
        if bad_lr:
            raise ConfigError(f"finetune_lr: unknown methods {bad_lr}: expected some of "
                              f"{tuple(METHODS)}")
        for key in ("methods", "seed_methods", "seed_control_methods"):
            bad = [m for m in getattr(self, key) if m not in METHODS]
            if bad:
                raise ConfigError(f"{key}: unknown methods {bad}: expected some of "
                                  f"{tuple(METHODS)}")
        for key in ("types", "seed_types"):
            try:
                parse_types(getattr(self, key))
            except ValueError as e:
                raise ConfigError(f"{key}: {e}") from None
        if self.beside is not None:
            try:
                check_beside_folder(self.beside)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.seed_regime and self.seed_methods and self.seed_methods[0] != SHARED_METHOD.name:
            raise ConfigError(f"seed_methods: {self.seed_methods} must start with "
                              f"{SHARED_METHOD.name!r} (it sets the others' storage)")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ExperimentConfig:
        return dataclass_from_dict(cls, raw, {"finetune": FinetuneConfig,
                                              "seed_finetune": FinetuneConfig,
                                              "seed_control_finetune": FinetuneConfig})


def whole_finetune(cfg: ExperimentConfig, method: str,
                   probed: dict[str, float] | None = None) -> FinetuneConfig:
    """The whole-model fine-tuning of ``method``: ``cfg.finetune`` at its own rate when
    the probe chose one (``probed``) or ``cfg.finetune_lr`` names one."""
    lr = (probed or {}).get(method, cfg.finetune_lr.get(method))
    return cfg.finetune if lr is None else dataclasses.replace(cfg.finetune, lr=lr)


def methods_at(cfg: ExperimentConfig, reduction: float) -> list[str]:
    """The whole-model methods at ``reduction`` (``methods_at`` narrows ``methods``)."""
    named = cfg.methods_at.get(reduction)
    return list(cfg.methods) if named is None else [m for m in cfg.methods if m in named]


def probe_reduction(cfg: ExperimentConfig) -> float:
    """The reduction the learning-rate probe runs at."""
    return cfg.lr_probe_reduction if cfg.lr_probe_reduction is not None else max(cfg.reductions)
