"""Configuration of ``structlm share analyze``: every field with its valid range, and the
decision thresholds, fixed before any test runs (written into the report's
``config.json``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from structlm.config import (
    ConfigError,
    Distinct,
    NonEmpty,
    OneOf,
    Range,
    dataclass_from_dict,
    validated,
)
from structlm.hf.adapters import parse_types

__all__ = ["AnalysisConfig", "Thresholds"]


@dataclass
@validated
class Thresholds:
    """Decision thresholds, fixed before the run."""

    alignment_max_residual: Annotated[float, Range(ge=0)] = 0.5
    """Test 1 lives if the median cheap-move (perm + diagonal) residual is at most this...
    (the cheap-move drop from the ``scale`` baseline and its split are reported beside,
    not used by the verdict)"""
    alignment_min_margin: Annotated[float, Range()] = 0.1
    """...and at least this far below the null's."""
    subspace_min_score: Annotated[float, Range(ge=0, le=1)] = 0.5
    """Test 2 lives if the mean score is at least this..."""
    subspace_min_margin: Annotated[float, Range()] = 0.2
    """...and at least this far above the null control's score (one null draw: no
    interval)."""
    functional_min_margin: Annotated[float, Range(gt=0, lt=1)] = 0.5
    """Test 3 lives if the interval of its normalised margin ``m = (score − null) /
    (1 − null)`` over the calibration draws lies above this, fails if it lies below,
    else is undecided. 0.5: the real matrices close at least half of the gap between the
    null and the ceiling. Fixed on 2026-12-07, before the re-runs over draws."""
    functional_min_draws: Annotated[int, Range(ge=2)] = 3
    """Test 3 gives no verdict with fewer calibration draws than this."""
    classifier_max_p: Annotated[float, Range(gt=0, le=1)] = 0.05
    """The role signature transfers if accuracy beats the majority rate with p ≤ this."""


@dataclass
@validated
class AnalysisConfig:
    """One analysis run (every field settable from the CLI or a YAML file)."""

    model: Annotated[str, NonEmpty()] = "smollm2"
    corpus: Annotated[str, NonEmpty()] = "austen"
    """Calibration corpus; its held-out documents are the in-domain evaluation text."""
    second_corpus: str = "shakespeare"
    """A different-domain corpus for perplexity only ("" to skip)."""
    eval_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.25
    """Fraction of the corpus's documents held out for evaluation (split by document, seeded)."""
    calib_tokens: Annotated[int, Range(ge=1)] = 32768
    """Calibration tokens: windows of seq_len drawn across all calibration documents (at
    least one window)."""
    seq_len: Annotated[int, Range(ge=2)] = 512
    """Window length of calibration and perplexity (at most the model's context)."""
    batch_size: Annotated[int, Range(ge=1)] = 4
    """Windows per forward pass."""
    eval_tokens: Annotated[int, Range(ge=0, note="0 skips perplexity")] = 16384
    """Tokens per corpus for perplexity."""
    types: Annotated[str, NonEmpty()] = "all"
    """Matrix types analysed: all, attn, mlp or q,k,v,o,mlp_in,mlp_out."""
    layers: Annotated[list[Annotated[int, Range(ge=0)]] | None, Distinct()] = None
    """Layers to analyse, at least 3 (``None``: all)."""
    reference_layer: Annotated[int | None, Range(ge=0)] = None
    """Test 1's reference layer, one of ``layers`` (``None``: the middle of ``layers``)."""
    k_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.25
    """Subspace size per side, tests 2–3: ``k_in = k_fraction × in`` on the input side and
    ``k_out = k_fraction × out`` on the output side (d/4 for square matrices; SmolLM2's
    192×576 K and V: ``k_out = 48``, ``k_in = 144``; its 3072×576 MLP-in: ``k_out = 768``,
    above the rank 576, so that side's own subspace is the whole column space)."""
    sink_pass: bool = True
    """Test 3 with attention-sink positions excluded: a second forward pass over the same
    calibration tokens (about the calibration's cost; cached beside it). ``False`` skips
    that variant; the uncentred and centred variants need no extra pass."""
    sink_tokens: Annotated[int, Range(ge=1)] = 4
    """Positions at the start of every calibration window left out of the sink-excluded
    covariance (fewer than ``seq_len``)."""
    energy: Annotated[float, Range(gt=0, le=1)] = 0.9
    """Energy fraction that defines the effective rank (tests 2–3)."""
    eig_floor: Annotated[float, Range(ge=0, lt=1)] = 1e-8
    """Relative eigenvalue floor of the covariance square roots (test 3)."""
    permutations: Annotated[int, Range(ge=1)] = 500
    """Label shuffles of the role classifier's permutation test."""
    seed: Annotated[int, Range(ge=0)] = 0
    """Seed of the document split, the windows, the nulls and the permutations."""
    tests: Annotated[list[Annotated[int, OneOf(1, 2, 3)]], NonEmpty(), Distinct()] = field(
        default_factory=lambda: [1, 2, 3])
    """Which of tests 1–3 to run. The perplexity of the unmodified model and the role
    classifier run with test 1 or 2 (``3`` alone runs only test 3 over the draws)."""
    calib_seeds: Annotated[list[Annotated[int, Range(ge=0)]], NonEmpty(), Distinct()] = field(
        default_factory=lambda: [0, 1, 2])
    """Test 3's calibration draws (windows drawn from the same calibration documents;
    draw 0 is the analysis's own calibration, draw ``k`` is drawn with seed ``k``); each
    draw redraws its own nulls. Test 3's verdict needs ``functional_min_draws`` of them."""
    thresholds: Thresholds = field(default_factory=Thresholds)

    def __post_init__(self) -> None:
        """Cross-field checks (each field's own range is checked by ``@validated``)."""
        if not isinstance(self.thresholds, Thresholds):
            raise ConfigError(f"thresholds: {self.thresholds!r} is not a mapping of "
                              "Thresholds keys")
        try:
            parse_types(self.types)
        except ValueError as e:
            raise ConfigError(f"types: {e}") from None
        if self.calib_tokens < self.seq_len:
            raise ConfigError(f"calib_tokens: {self.calib_tokens} is fewer than one window of "
                              f"seq_len={self.seq_len}")
        if self.sink_pass and not self.sink_tokens < self.seq_len:
            raise ConfigError(f"sink_tokens: {self.sink_tokens} must be below seq_len="
                              f"{self.seq_len} (or set sink_pass: false)")
        if self.seed != 0 and self.seed in self.calib_seeds:
            raise ConfigError(f"calib_seeds: {self.seed} draws the windows of draw 0 again "
                              f"(seed={self.seed} draws draw 0's): every draw must differ")
        if self.layers is not None and len(self.layers) < 3:
            raise ConfigError(f"layers: {self.layers} holds fewer than 3 indices (test 1 "
                              "compares layers with a reference, at several distances)")
        if (self.layers is not None and self.reference_layer is not None
                and self.reference_layer not in self.layers):
            raise ConfigError(f"reference_layer: {self.reference_layer} is not among the "
                              f"analysed layers {self.layers}")

    def check_model(self, num_layers: int, context: int | None) -> None:
        """Refuse what the loaded model cannot give (before any work): ``seq_len`` beyond
        its ``context`` (``None``: unknown) or ``layers`` beyond its ``num_layers``."""
        if context is not None and self.seq_len > context:
            raise ConfigError(f"seq_len: {self.seq_len} is beyond the context of model "
                              f"{self.model!r} ({context} positions)")
        layers = self.layers if self.layers is not None else range(num_layers)
        bad = [i for i in layers if i >= num_layers]
        if bad:
            raise ConfigError(f"layers: {bad} are out of range for model {self.model!r} "
                              f"(layers 0 to {num_layers - 1})")
        if self.reference_layer is not None and self.reference_layer >= num_layers:
            raise ConfigError(f"reference_layer: {self.reference_layer} is out of range for "
                              f"model {self.model!r} (layers 0 to {num_layers - 1})")
        if self.layers is None and num_layers < 3:
            raise ConfigError(f"model {self.model!r} has {num_layers} layers: the analysis "
                              "needs at least 3")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> AnalysisConfig:
        return dataclass_from_dict(cls, raw, {"thresholds": Thresholds})
