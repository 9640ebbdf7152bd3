"""The description of a conversion, :class:`AlgebraConfig` (checked when built), and the
key under which a converted model's config records it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from structlm.algebra import Algebra, AlgebraError, get_algebra, support_of
from structlm.config import ConfigError
from structlm.hf.adapters import MatrixType, parse_types
from structlm.nn.schedules import TypeSchedule, get_schedule

__all__ = ["CONFIG_KEY", "GROUPS", "INITS", "AlgebraConfig"]

CONFIG_KEY = "structlm_conversion"
"""The key of the conversion record in a converted model's config (and in its saved
weights' safetensors metadata)."""
INITS = ("copy", "calibrated")
GROUPS = ("equal", "heads")
_ATTN = {MatrixType.Q, MatrixType.K, MatrixType.V, MatrixType.O}
_FFN = {MatrixType.MLP_IN, MatrixType.MLP_OUT}


@dataclass(frozen=True)
class AlgebraConfig:
    """How to convert a model (checked when built)."""

    algebra: str | Algebra = "Q2^2"
    """Product rule: a catalogue name (Q4, Q2^2, ...; ``structlm algebra table``) or an
    :class:`~structlm.algebra.Algebra`; it must be associative with a unit (what a layer
    needs). Only a named algebra can be restored by :func:`load_converted`."""
    schedule: str = "cyclic"
    """Position types: cyclic (p mod q), block:<size>[:<period>], table:..., or
    cross-layer:<one of these>. Cyclic by default: every window of q tokens holds every
    type, whatever the context of a pretrained model."""
    targets: str = "mlp"
    """Matrix types converted: mlp (the FFN projections, the default), attn, all, or a
    list of q,k,v,o,mlp_in,mlp_out (a fused qkv needs q, k and v together, and becomes
    one algebra layer: see :func:`convert_`)."""
    init: str = "copy"
    """``copy``: every weight kept bit for bit (each type then drops the blocks its support
    does not use); ``calibrated``: the blocks refitted so that every type's product
    approximates the dense projection on calibration activations (float64, ridge toward
    the dense weight, layer by layer: :mod:`structlm.convert.calibrate`). The parameter
    count is the same either way; ``calibrated`` changes the values, and
    :func:`convert_` then needs ``calibration`` token ids."""
    ridge: float | None = None
    """With ``init="calibrated"``: the relative ridge ``lambda = ridge * trace(G) / K``;
    ``None`` chooses it per module from ``calibrate.RIDGES`` by the error on every 8th
    calibration window, held out (then refits on all)."""
    permute: bool = False
    """Before converting, reorder every FFN's hidden units (with FFN targets) and every
    layer's attention heads (with q, k, v and o targets; ``groups="heads"``), a
    function-preserving permutation, so that each type keeps as much of the calibration
    output as possible (:mod:`structlm.convert.permute`, :mod:`structlm.convert.heads`;
    needs ``calibration`` ids)."""
    groups: str = "equal"
    """``equal``: every projection split into ``q`` equal groups; ``heads``: the head side
    of the attention projections (Q/K/V outputs, O inputs) in groups of whole heads
    where there are at least ``q`` heads (:mod:`structlm.convert.heads`; separate
    q/k/v/o projections and attention targets)."""

    def __post_init__(self) -> None:
        try:
            support = support_of(self.algebra_object())
        except AlgebraError as e:  # keep its message, name the field
            raise ConfigError(f"algebra {self.algebra_name!r}: {e}") from None
        if support.q < 2:
            raise ConfigError(f"algebra {self.algebra_name!r} has one type: converting to "
                              "it changes nothing (use Q2, Q4, Q2^2, ...)")
        get_schedule(self.schedule, support.q)  # raises a ValueError naming the spec
        parse_types(self.targets)
        types = set(parse_types(self.targets))
        if self.groups not in GROUPS:
            raise ConfigError(f"groups: {self.groups!r} is not valid: expected one of "
                              f"{GROUPS}")
        if self.groups == "heads" and not types & _ATTN:
            raise ConfigError(f"groups: 'heads' aligns the attention projections' groups to "
                              f"heads, but targets {self.targets!r} hold none of q, k, v, o")
        if self.permute and not (_FFN <= types or _ATTN <= types):
            raise ConfigError(f"permute: reorders FFN hidden units or attention heads, so "
                              f"targets must hold mlp_in and mlp_out (mlp) or q, k, v and o "
                              f"(attn), got {self.targets!r}")
        if self.permute and _ATTN <= types and self.groups != "heads":
            raise ConfigError(f"permute with attention targets ({self.targets!r}) moves "
                              "whole heads between groups: set groups='heads'")
        if self.init not in INITS:
            raise ConfigError(f"init: {self.init!r} is not valid: expected one of {INITS}")
        if self.ridge is not None and not (isinstance(self.ridge, int | float)
                                           and math.isfinite(self.ridge) and self.ridge > 0):
            raise ConfigError(f"ridge: {self.ridge!r} is out of range: expected > 0, or "
                              "None (chosen on held-out calibration windows)")

    def algebra_object(self) -> Algebra:
        return self.algebra if isinstance(self.algebra, Algebra) else get_algebra(self.algebra)

    @property
    def algebra_name(self) -> str:
        return self.algebra.name if isinstance(self.algebra, Algebra) else self.algebra

    @property
    def q(self) -> int:
        return support_of(self.algebra_object()).q

    def record(self) -> dict[str, Any]:
        """The JSON-able description saved in the model's config (a custom
        :class:`Algebra` is marked: only a catalogue name can be rebuilt)."""
        return {"algebra": self.algebra_name, "schedule": self.schedule,
                "targets": self.targets, "custom_algebra": isinstance(self.algebra, Algebra),
                "init": self.init, **({"ridge": self.ridge} if self.init != "copy" else {}),
                **({"permute": True} if self.permute else {}),
                **({"groups": self.groups} if self.groups != "equal" else {})}

    def type_schedule(self) -> TypeSchedule:
        return get_schedule(self.schedule, self.q)
