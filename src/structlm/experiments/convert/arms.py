"""The arms of ``structlm experiment convert`` and how each changes a fresh copy of the
model.

An arm is one way to reach a MAC budget on one target (``mlp`` or ``attn``):

* ``algebra`` — :func:`~structlm.convert.convert_` to the budget's algebra, started by
  one of the :data:`VARIANTS`: ``copy`` (every weight kept), ``calibrated`` (the blocks
  refitted to the dense projection on calibration activations, layer by layer),
  ``+permute`` (a function-preserving permutation of FFN units first; on attention, of
  whole heads, with the groups aligned to heads: :mod:`structlm.convert.heads`),
  ``+distill`` (layer-wise distillation toward the dense modules before healing);
* ``prune`` (FFN only) — FFN-width pruning to the budget's MACs;
* ``svd`` — whitened low-rank factorisation of the target at the budget's MACs;
* ``dense`` — the unchanged model, healed the same way (the domain-adaptation control).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from torch import nn

from structlm.convert.convert import AlgebraConfig, convert_
from structlm.convert.typed_linear import TypedAlgebraLinear
from structlm.experiments.convert.baselines import prune_ffn_width_
from structlm.hf.adapters import MatrixType, get_adapter, parse_types
from structlm.hf.finetune import trainable_parameters
from structlm.hf.pipeline import Prepared
from structlm.share.compress import CompressionConfig, compress_model
from structlm.share.compress.methods import SVD_LLM_W_METHOD

__all__ = ["BASELINES", "VARIANTS", "Arm", "change_model", "mac_ratio", "variant_parts"]

BASELINES = ("prune", "svd")
VARIANTS = ("copy", "calibrated", "calibrated+permute", "calibrated+distill",
            "calibrated+permute+distill")
"""How an algebra arm starts (see the module docstring)."""


def variant_parts(variant: str) -> tuple[str, bool, bool]:
    """``(init, permute, distill)`` of a variant name."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: expected one of {VARIANTS}")
    parts = variant.split("+")
    return parts[0], "permute" in parts, "distill" in parts


@dataclass(frozen=True)
class Arm:
    """One arm: its kind (algebra | prune | svd | dense), target, the algebra whose MACs
    it matches (``""`` for the dense control) and, for an algebra arm, its variant."""

    kind: str
    target: str
    budget: str
    variant: str = ""

    @property
    def name(self) -> str:
        return {"algebra": f"{self.budget} {self.variant}",
                "prune": f"prune to {self.budget} MACs", "svd": f"svd-llm-w at {self.budget} MACs",
                "dense": "dense (control)"}[self.kind]

    @property
    def distills(self) -> bool:
        return self.kind == "algebra" and variant_parts(self.variant)[2]

    def algebra_config(self, schedule: str) -> AlgebraConfig:
        """The conversion of an algebra arm (or the budget's algebra, for a baseline)."""
        if self.kind != "algebra":
            return AlgebraConfig(self.budget, schedule, self.target)
        init, permute, _ = variant_parts(self.variant)
        heads = permute and self.target == "attn"  # whole heads move between head groups
        return AlgebraConfig(self.budget, schedule, self.target, init=init, permute=permute,
                             groups="heads" if heads else "equal")


def _site_parameters(model: nn.Module, target: str) -> list[nn.Parameter]:
    """Parameters of the target projections (the modules at the adapter's sites)."""
    types = set(parse_types(target))
    return [p for layer in get_adapter(model).layers for site in layer.linear_sites()
            if types & set(site.types) for p in site.module.parameters()]


def mac_ratio(cfg: AlgebraConfig) -> Fraction:
    """The algebra's MACs as a fraction of dense, with every type equally frequent."""
    from structlm.algebra import support_of

    support = support_of(cfg.algebra_object())
    return support.mac_ratio((1,) * support.q, (1,) * support.q)


def change_model(model: nn.Module, arm: Arm, prep: Prepared, schedule: str,
                 progress: bool = False) -> tuple[list[nn.Parameter], dict[str, Any] | None]:
    """Apply ``arm`` to ``model`` in place. Returns the parameters healing trains and, for
    an algebra arm, its :func:`~structlm.convert.conversion_info` (with the calibration
    summary of a calibrated start)."""
    from structlm.convert import conversion_info

    if arm.kind == "dense":
        return _site_parameters(model, arm.target), None
    rho = arm.algebra_config(schedule)
    if arm.kind == "algebra":
        wants = rho.init == "calibrated" or rho.permute
        convert_(model, rho, calibration=prep.calib_ids if wants else None, progress=progress)
        params = [p for m in model.modules() if isinstance(m, TypedAlgebraLinear)
                  for p in m.parameters()]
        return params, conversion_info(model)
    ratio = mac_ratio(rho)
    assert prep.calibration is not None
    if arm.kind == "prune":
        f = get_adapter(model).layers[0].weight(MatrixType.MLP_OUT).shape[1]
        keep = int(ratio * f)  # floor: never above the algebra's MACs
        prune_ffn_width_(model, prep.calibration, keep)
        return _site_parameters(model, "mlp"), None
    compress_model(get_adapter(model), prep.calibration,
                   CompressionConfig(method=SVD_LLM_W_METHOD.name, types=arm.target,
                                     target_reduction=float(1 - ratio)),
                   calib_tokens=prep.calib_ids)
    return trainable_parameters(model), None
