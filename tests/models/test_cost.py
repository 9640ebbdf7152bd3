"""``structlm cost`` and the model MAC accounting."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

pytest.importorskip("transformers")

from structlm.cli import main
from structlm.models import StructLMForCausalLM, config_from_preset
from structlm.models.cost import model_cost, parameter_count


@pytest.mark.parametrize("preset", ["tiny", "cpu-small"])
@pytest.mark.parametrize("algebra", ["dense", "Q2^2", "Q4"])
def test_parameter_formula_matches_model(preset: str, algebra: str) -> None:
    cfg = config_from_preset(preset, algebra)
    model = StructLMForCausalLM(cfg)
    assert parameter_count(cfg) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_paper_numbers() -> None:
    cost = model_cost(config_from_preset("paper-110m", "Q2^2"))
    assert cost["parameters"] == 110_631_168
    assert cost["projection_mac_ratio"] == "59/80" and cost["rho_ffn"] == "9/16"
    train = cost["training_macs_per_token"]
    assert train["ffn"]["algebra"] * 16 == train["ffn"]["dense"] * 9
    assert train["attention_projections"]["algebra"] == train["attention_projections"]["dense"]


def test_cost_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cost", "--preset", "paper-110m", "--algebra", "Q2^2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["parameters"], int) and out["parameters"] == 110_631_168
    assert out["projection_mac_ratio"] == "59/80"
    assert main(["cost", "--preset", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(("algebra", "fwd", "train"),
                         [("Q4", 1.391, 1.474), ("Q2^2", 1.280, 1.333)])
def test_structured_score_bounds_are_the_seeds(algebra: str, fwd: float, train: float) -> None:
    from structlm.models.cost import score_cost

    sc = score_cost(config_from_preset("paper-110m", algebra))
    assert sc is not None
    assert round(float(Fraction(sc["forward_bound_limit"])), 3) == fwd
    assert round(float(Fraction(sc["training_bound_limit"])), 3) == train
    # the paper's 192-blocks over a full causal context are near the balanced limit
    assert abs(Fraction(sc["rho_score"]) - Fraction(sc["rho_score_balanced_limit"])) < 1e-3


def test_structured_scores_cut_only_the_qk_half() -> None:
    off = model_cost(config_from_preset("paper-110m", "Q2^2"))
    on = model_cost(config_from_preset("paper-110m", "Q2^2", structured_scores=True))
    a, b = (c["training_macs_per_token"]["attention_scores"] for c in (off, on))
    rho = Fraction(on["scores"]["rho_score"])
    assert a["dense"] == b["dense"] == a["algebra"]
    assert abs(b["algebra"] - a["dense"] * (1 + rho) / 2) <= 1
    assert on["training_macs_per_token"]["ffn"] == off["training_macs_per_token"]["ffn"]
