"""Budgets solved or refused before any work: on a grid of tiny shapes, every method whose
ranks follow from the shapes either stores within the tolerance below its budget or the
plan is refused before calibration, naming reductions that can be met — and those do."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")

from structlm.experiments.share.budget import check_budgets_feasible, planned_stored
from structlm.experiments.share.config import ExperimentConfig
from structlm.experiments.share.experiment import run_experiment
from structlm.hf.adapters import get_adapter
from structlm.share.compress.apply import CompressionConfig
from tiny_models import tiny_llama

METHODS = ("svd-llm-w", "svd-llm", "basis-sharing")
SHAPES = [dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3),
          dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4),
          dict(hidden_size=48, intermediate_size=80, num_hidden_layers=5,
               num_attention_heads=6, num_key_value_heads=2)]


@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("types", ["all", "attn"])
def test_every_budget_is_met_or_refused_with_reductions_that_can_be(shape, types) -> None:
    adapter = get_adapter(tiny_llama(**SHAPES[shape]))
    tol, checked = 0.005, 0
    for method in METHODS:
        for red in (0.2, 0.3, 0.4, 0.5):
            ccfg = CompressionConfig(method=method, types=types, target_reduction=red)
            planned = planned_stored(adapter, ccfg)
            assert planned is not None  # these methods plan from the shapes
            stored, budget = planned
            ok = -tol <= stored / budget - 1 <= 1e-12
            if ok:
                check_budgets_feasible(adapter, [(method, ccfg)], tol)
                continue
            with pytest.raises(ValueError, match=rf"{method} at reduction {red:g} stores "
                                                 rf"{stored:,} of a budget") as e:
                check_budgets_feasible(adapter, [(method, ccfg)], tol)
            wider = float(re.search(r"budget_tolerance >= ([0-9.]+) accepts",
                                    str(e.value)).group(1))  # type: ignore[union-attr]
            check_budgets_feasible(adapter, [(method, ccfg)], wider)  # and it does
            named = re.search(r"reductions that can be met: \[([^\]]*)\]", str(e.value))
            if named is None:
                assert "no reduction within ±0.1 can be met" in str(e.value)
                continue
            for r in (float(x) for x in named.group(1).split(",")):
                s, b = planned_stored(adapter, CompressionConfig(
                    method=method, types=types, target_reduction=r))  # type: ignore[misc]
                assert -tol <= s / b - 1 <= 1e-12, (method, r)
                checked += 1
    assert checked or shape < 2  # the finest grid names reductions that can be met


def test_the_experiment_refuses_an_unmeetable_budget_before_any_work(tmp_path) -> None:
    """``experiment share --methods svd-llm-w --reductions 0.4 --types attn`` on a tiny
    LLaMA once stopped with an AssertionError after the calibration work."""
    src = tmp_path / "tiny"
    tiny_llama().save_pretrained(src)
    ex = ExperimentConfig(model=str(src), methods=["svd-llm-w"], reductions=[0.4],
                          types="attn", seeds=[0])
    with pytest.raises(ValueError, match=r"svd-llm-w at reduction 0.4 stores .* checked "
                                         "before any calibration|cannot be met"):
        run_experiment(ex, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
