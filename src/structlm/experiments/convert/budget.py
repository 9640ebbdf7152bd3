"""The baselines' MAC budgets checked from the architecture alone, before any work: a
baseline (FFN-width pruning, SVD-LLM-W) whose planned projection MACs miss its algebra
arm's by more than ``mac_tolerance`` (a tiny model's widths move in coarse steps) is a
configuration error naming the arm, the deviation and the tolerance that would accept
it — never an assertion after the calibration work."""

from __future__ import annotations

import math
from fractions import Fraction

from torch import nn

from structlm.config import ConfigError
from structlm.experiments.convert.arms import Arm, mac_ratio
from structlm.hf.adapters import MatrixType, get_adapter, parse_types
from structlm.hf.macs import projection_macs
from structlm.share.compress import CompressionConfig
from structlm.share.compress.apply import plan_types
from structlm.share.compress.methods import SVD_LLM_W_METHOD, get_method

__all__ = ["baseline_budget", "check_baseline_budgets", "planned_baseline_macs"]


def baseline_budget(arch: nn.Module, arm: Arm, schedule: str) -> float:
    """The projection MACs the baseline must reach: the original's minus what the
    algebra removes from its target (``(1 − rho)`` of the target's dense MACs)."""
    types = set(parse_types(arm.target))
    target = sum(site.module.weight.numel() for layer in get_adapter(arch).layers
                 for site in layer.linear_sites() if types & set(site.types))
    rho = mac_ratio(arm.algebra_config(schedule))
    return float(projection_macs(arch) - (1 - rho) * target)


def planned_baseline_macs(arch: nn.Module, arm: Arm, schedule: str) -> float:
    """The projection MACs ``arm`` (prune or svd) will have, from the shapes alone."""
    ratio = mac_ratio(arm.algebra_config(schedule))
    adapter = get_adapter(arch)
    total = projection_macs(arch)
    if arm.kind == "prune":
        f = adapter.layers[0].weight(MatrixType.MLP_OUT).shape[1]
        keep = int(ratio * f)  # as change_model prunes: floor
        mlp = sum(site.module.weight.numel() for layer in adapter.layers
                  for site in layer.linear_sites()
                  if {MatrixType.MLP_IN, MatrixType.MLP_OUT} & set(site.types))
        return float(total - Fraction(mlp) * (f - keep) / f)
    ccfg = CompressionConfig(method=SVD_LLM_W_METHOD.name, types=arm.target,
                             target_reduction=float(1 - ratio))
    L = adapter.num_layers
    for plan in plan_types(adapter, ccfg):
        assert plan.ranks is not None  # svd-llm-w plans its ranks from the shapes
        out, inn = plan.shape
        total -= L * out * inn
        total += get_method(plan.method).token_macs(out, inn, plan.ranks,
                                                    [len(g) for g in plan.groups], plan.parts)
    return float(total)


def check_baseline_budgets(arch: nn.Module, arms: list[Arm], schedule: str, tol: float
                           ) -> None:
    """Refuse the plan if any baseline's planned MACs fall outside ``−tol..0`` of its
    budget.

    Raises:
        ConfigError: naming every such arm, its deviation and the tolerance needed.
    """
    problems = []
    for arm in arms:
        if arm.kind not in ("prune", "svd"):
            continue
        budget = baseline_budget(arch, arm, schedule)
        dev = planned_baseline_macs(arch, arm, schedule) / budget - 1
        if not -tol <= dev <= 1e-9:
            need = math.ceil(-dev * 1000 - 1e-9) / 1000
            problems.append(f"{arm.name} on {arm.target}: planned projection MACs {dev:+.2%} "
                            f"from the budget (allowed −{tol:.1%}..0)"
                            + (f"; mac_tolerance >= {need} accepts it" if dev < 0 else ""))
    if problems:
        raise ConfigError("baselines that cannot meet their MAC budget on this model's "
                          "shapes (checked before any calibration; drop them from "
                          "baselines or widen mac_tolerance): " + "; ".join(problems))
