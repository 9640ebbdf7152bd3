"""The learning-rate probe of ``structlm experiment share``: before the whole-model runs,
each fine-tuned method is fine-tuned at every probe rate (one setting, the first seed and
calibration draw, ``lr_probe_steps`` steps, best validation checkpoint), and its rate is
the one whose best **validation** NLL is lowest (:func:`choose_rate`). The test windows
play no part: the curves hold validation scores only (``structlm.hf.finetune`` refuses any
other windows), and :func:`choose_rate` refuses a curve without them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from structlm.hf.finetune import FinetuneConfig

__all__ = ["best_validation", "choose_rate", "probe_finetune"]


def best_validation(curve: list[dict[str, Any]]) -> tuple[float, int]:
    """The lowest validation NLL of a fine-tuning curve and its step (the earliest on a
    tie). Raises on a curve without validation scores (an old curve scored on test
    windows cannot decide anything)."""
    pts = [(c["val_nll"], c["step"]) for c in curve if c.get("val_nll") is not None]
    if not pts:
        raise ValueError("the curve holds no validation scores ('val_nll'): a decision reads "
                         "validation windows only")
    nll, step = min(pts, key=lambda p: (p[0], p[1]))
    if not math.isfinite(nll):
        raise ValueError(f"non-finite validation NLL at step {step}")
    return float(nll), int(step)


def choose_rate(curves: dict[float, list[dict[str, Any]]]) -> dict[str, Any]:
    """The rate whose curve reaches the lowest validation NLL (the lower rate on a tie),
    with every rate's best and whether the choice lies at the edge of the grid (a rate
    outside it might be better)."""
    if not curves:
        raise ValueError("no probe curves to choose a rate from")
    best = {r: best_validation(c) for r, c in curves.items()}
    rate = min(best, key=lambda r: (best[r][0], r))
    rates = sorted(curves)
    return {"rate": rate, "best_val_nll": {str(r): best[r][0] for r in rates},
            "best_step": {str(r): best[r][1] for r in rates},
            "at_edge": len(rates) > 1 and rate in (rates[0], rates[-1])}


def probe_finetune(ft: FinetuneConfig, rate: float, steps: int) -> FinetuneConfig:
    """The probe's fine-tuning at ``rate``: the whole-model config, ``steps`` long, best
    validation checkpoint kept."""
    return dataclasses.replace(ft, lr=rate, steps=steps, keep_best=True)
