"""Budgets checked before any work: every whole-model arm whose ranks follow from the
shapes alone must store within ``budget_tolerance`` below its budget, else the plan is
refused with the nearest reductions that can be met (a tiny model's ranks move the
stored count in steps larger than the tolerance)."""

from __future__ import annotations

from typing import Any

from structlm.share.compress.apply import CompressionConfig, plan_types
from structlm.share.compress.methods import get_method

__all__ = ["check_budgets_feasible", "planned_stored"]


def planned_stored(adapter: Any, ccfg: CompressionConfig) -> tuple[int, float] | None:
    """``(stored parameters, budget)`` of ``ccfg`` on ``adapter``'s shapes, or ``None``
    when a type's ranks are chosen from the calibration data (checked afterwards)."""
    stored, original = 0, 0
    L = adapter.num_layers
    for plan in plan_types(adapter, ccfg):
        if plan.ranks is None:
            return None
        out, inn = plan.shape
        stored += get_method(plan.method).stored_parameters(
            out, inn, plan.ranks, [len(g) for g in plan.groups], plan.parts)
        original += L * out * inn
    assert ccfg.target_reduction is not None
    return stored, (1 - ccfg.target_reduction) * original


def _within(stored: int, budget: float, tol: float) -> bool:
    return -tol <= stored / budget - 1 <= 1e-12


def check_budgets_feasible(adapter: Any, arms: list[tuple[str, CompressionConfig]],
                           tol: float) -> None:
    """Refuse every ``(name, config)`` arm whose planned storage misses its budget.

    Raises:
        ValueError: naming each arm, its planned deviation and the nearest reductions
            (within ±0.1 of the asked one, step 0.001) whose budget the ranks meet.
    """
    problems = []
    for name, ccfg in arms:
        planned = planned_stored(adapter, ccfg)
        if planned is None or _within(*planned, tol):
            continue
        stored, budget = planned
        red = float(ccfg.target_reduction or 0.0)
        near = []
        for step in range(1, 101):
            for r in (red - step / 1000, red + step / 1000):
                if 0 < r < 1:
                    other = planned_stored(adapter, _at(ccfg, r))
                    if other is not None and _within(*other, tol):
                        near.append(round(r, 3))
            if len(near) >= 2:
                break
        problems.append(f"{name} at reduction {red:g} stores {stored:,} of a budget of "
                        f"{budget:,.0f} ({stored / budget - 1:+.2%}; allowed "
                        f"−{tol:.1%}..0): its ranks move in steps too coarse for this "
                        "model's shapes; " + (f"reductions that can be met: {near}" if near
                                              else "no reduction within ±0.1 can be met")
                        + f" (or budget_tolerance >= {_ceil_tol(1 - stored / budget)} "
                        "accepts it)")
    if problems:
        raise ValueError("budgets that cannot be met (checked before any calibration): "
                         + "; ".join(problems))


def _ceil_tol(shortfall: float) -> float:
    """The smallest tolerance (rounded up to 0.1%) that accepts ``shortfall``."""
    import math

    return math.ceil(shortfall * 1000 - 1e-9) / 1000


def _at(ccfg: CompressionConfig, reduction: float) -> CompressionConfig:
    import dataclasses

    return dataclasses.replace(ccfg, target_reduction=reduction)
