"""``structlm experiment study`` configuration: arms trained on the same data, tokens, learning-rate
schedule and seeds, validated before any work starts.

An arm is a model variant: the FFN algebra, the FFN width (the preset's, a number, or
``mac-match:<algebra>``: the dense width whose FFN MACs equal that algebra's at the
preset's width), the type schedule and structured scores. Every arm shares the ``train``
block (steps, batch, context, optimiser), so every run sees the same number of tokens;
only the model and the seed differ. The checks run at load:

* arm names are distinct, and so are the arms' models;
* every algebra arm's schedule gives every type a position in a training window;
* equal-parameter arms (the preset's FFN width) have exactly the dense reference's
  parameter count; ``mac-match`` arms have exactly the matched algebra's FFN MACs;
* the FFN carries at least half of the non-embedding forward MACs per token.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any

from structlm.config import ConfigError, Distinct, NonEmpty, OneOf, Range, validated
from structlm.models.presets import PRESETS
from structlm.train.loop import TrainConfig

__all__ = ["ArmSpec", "StudyConfig", "load_study_config", "run_summary"]

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

    def __post_init__(self) -> None:
        """Cross-field checks (each field's own range is checked by ``@validated``)."""
        if "/" in self.name or self.name != self.name.strip():
            raise ConfigError(f"arm name {self.name!r} must be without '/' or surrounding "
                              "spaces")
        if isinstance(self.ffn, int) and self.ffn < 1:
            raise ConfigError(f"arm {self.name!r}: ffn width {self.ffn} must be >= 1")
        if isinstance(self.ffn, str) and self.ffn != "preset" and not (
                self.ffn.startswith("mac-match:")):
            raise ConfigError(f"arm {self.name!r}: ffn {self.ffn!r} must be 'preset', an "
                              "integer width or 'mac-match:<algebra>'")

    @property
    def is_dense(self) -> bool:
        """Whether the FFN is dense."""
        from structlm.algebra import is_dense

        return is_dense(self.algebra)


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

    def __post_init__(self) -> None:
        """Cross-field checks (each field's own range is checked by ``@validated``)."""
        bad = sorted(set(self.train) - set(_SHARED_TRAIN_FIELDS))
        if bad:
            raise ValueError(f"train: keys {bad} cannot be set for the whole study; expected "
                             f"some of {list(_SHARED_TRAIN_FIELDS)} (the model and seed are "
                             "per arm)")
        names = [a.name for a in self.arms]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"arm names {dup} are used twice")
        models: dict[tuple[Any, ...], str] = {}
        for arm in self.arms:
            key = (arm.algebra.strip().lower(), self.ffn_width(arm),
                   self.run_config(arm, arm.seeds[0]).model_schedule() if not arm.is_dense
                   else "", arm.structured_scores)
            if key in models:
                raise ValueError(f"arms {models[key]!r} and {arm.name!r} train the same model")
            models[key] = arm.name
        self._check_budgets()

    # ---------------------------------------------------------------- per arm
    def ffn_width(self, arm: ArmSpec) -> int:
        """The arm's FFN width ``F``."""
        base = int(PRESETS[self.preset]["intermediate_size"])
        if arm.ffn == "preset":
            return base
        if isinstance(arm.ffn, int):
            return arm.ffn
        from structlm.models.cost import _rho
        from structlm.models.presets import config_from_preset

        target = arm.ffn.split(":", 1)[1]
        width = Fraction(base) * _rho(config_from_preset(self.preset, target))
        if width.denominator != 1:
            raise ValueError(f"arm {arm.name!r}: {arm.ffn} needs FFN width {base} x rho = "
                             f"{width}, not an integer")
        return int(width)

    def run_config(self, arm: ArmSpec, seed: int) -> TrainConfig:
        """The :class:`TrainConfig` of one run (``arm``, ``seed``)."""
        overrides: dict[str, Any] = {"intermediate_size": self.ffn_width(arm)}
        if arm.structured_scores:
            overrides["structured_scores"] = True
        return TrainConfig(out_dir=f"{self.out_dir}/runs/{arm.name}/seed{seed}",
                           data_dir=f"{self.out_dir}/data", preset=self.preset,
                           algebra=arm.algebra, type_schedule=arm.type_schedule,
                           model_overrides=overrides, corpus=self.corpus,
                           tokenizer=self.tokenizer, data_seed=self.data_seed, seed=seed,
                           **self.train)

    def runs(self) -> list[tuple[ArmSpec, int]]:
        """Every (arm, seed), first seeds of every arm first (so one seed of each arm
        exists early), then the further seeds."""
        order = [(a, a.seeds[0]) for a in self.arms]
        depth = max(len(a.seeds) for a in self.arms)
        for k in range(1, depth):
            order += [(a, a.seeds[k]) for a in self.arms if len(a.seeds) > k]
        return order

    def model_config(self, arm: ArmSpec) -> Any:
        """The arm's model config (the preset's vocabulary: for the budget accounting)."""
        return self.run_config(arm, arm.seeds[0]).model_config()

    # ---------------------------------------------------------------- checks
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
                                                               ffn="preset"))
                want = model_cost(target)["training_macs_per_token"]["ffn"]["algebra"]
                if cost["ffn"]["algebra"] != want:
                    raise ValueError(f"arm {arm.name!r}: FFN MACs {cost['ffn']['algebra']:,} "
                                     f"differ from {arm.ffn[10:]}'s {want:,}")


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
    return dataclass_from_dict(StudyConfig, {**raw, "arms": arms}, where=path)


def run_summary(cfg: StudyConfig, arm: ArmSpec, seed: int) -> dict[str, Any] | None:
    """The finished run's ``final.json``, or ``None``."""
    path = Path(cfg.run_config(arm, seed).out_dir) / "final.json"
    return json.loads(path.read_text()) if path.exists() else None
