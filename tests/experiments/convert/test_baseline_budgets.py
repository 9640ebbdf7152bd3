"""The baselines' MAC budgets are checked from the shapes before any work: the planned
MACs equal what pruning and SVD-LLM-W really leave (on calibrated tiny models), and a
budget they cannot meet is a configuration error before the output folder exists."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from structlm.config import ConfigError
from structlm.experiments.convert.arms import Arm, mac_ratio
from structlm.experiments.convert.baselines import prune_ffn_width_
from structlm.experiments.convert.budget import (
    baseline_budget,
    check_baseline_budgets,
    planned_baseline_macs,
)
from structlm.experiments.convert.experiment import (
    ConvertExperimentConfig,
    run_convert_experiment,
)
from structlm.hf.adapters import MatrixType, get_adapter
from structlm.hf.calibration import calibrate
from structlm.hf.macs import projection_macs
from structlm.share.compress import CompressionConfig, compress_model
from tiny_models import tiny_llama


@pytest.mark.parametrize("algebra", ["Q4", "Q2^2", "graph:4:0-1"])
@pytest.mark.parametrize(("kind", "target"), [("prune", "mlp"), ("svd", "mlp"),
                                              ("svd", "attn")])
def test_planned_macs_are_what_the_baseline_leaves(algebra, kind, target) -> None:
    model = tiny_llama(hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    arm = Arm(kind, target, algebra)
    planned = planned_baseline_macs(model, arm, "cyclic")
    ad = get_adapter(model)
    ids = torch.randint(0, 89, (4, 32), generator=torch.Generator().manual_seed(2))
    cal = calibrate(ad, ids.reshape(-1), seq_len=32, batch_size=2, progress=False)
    ratio = mac_ratio(arm.algebra_config("cyclic"))
    if kind == "prune":
        f = ad.layers[0].weight(MatrixType.MLP_OUT).shape[1]
        prune_ffn_width_(model, cal, int(ratio * f))
    else:
        compress_model(ad, cal, CompressionConfig(method="svd-llm-w", types=target,
                                                  target_reduction=float(1 - ratio)),
                       calib_tokens=ids)
    assert float(projection_macs(model)) == pytest.approx(planned, rel=1e-12)


def test_an_unmeetable_baseline_budget_names_the_tolerance_that_accepts_it() -> None:
    arch = tiny_llama()  # hidden 32: one rank moves the MACs by several percent
    arms = [Arm("svd", "attn", "graph:4:0-1")]
    dev = planned_baseline_macs(arch, arms[0], "cyclic") / baseline_budget(
        arch, arms[0], "cyclic") - 1
    assert dev < -0.01
    with pytest.raises(ConfigError, match=r"svd-llm-w at graph:4:0-1 MACs on attn: planned "
                                          r"projection MACs -[0-9.]+% .*mac_tolerance >= "):
        check_baseline_budgets(arch, arms, "cyclic", 0.01)
    check_baseline_budgets(arch, arms, "cyclic", -dev + 1e-3)


def test_the_experiment_refuses_it_before_any_work(tmp_path) -> None:
    src = tmp_path / "tiny"
    tiny_llama().save_pretrained(src)
    ex = ConvertExperimentConfig(model=str(src), algebras=["graph:4:0-1"], targets=["attn"])
    with pytest.raises(ConfigError, match="cannot meet their MAC budget"):
        run_convert_experiment(ex, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
