"""Bad input is refused at the boundary; a saved model loads after ``import structlm``."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from structlm.cli.args import layer_list as _layers
from structlm.hf.pipeline import check_layers


@pytest.mark.parametrize(("text", "match"), [
    ("0,0,1", r"repeat \[0\]"),
    ("0-3,2", r"repeat \[2\]"),
    ("5-2", "empty layer range"),
    ("a,b", "bad layer list"),
])
def test_bad_layer_lists_are_refused_at_parse(text: str, match: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=match):
        _layers(text)


def test_layer_range_is_checked_against_the_model() -> None:
    assert _layers("0-2,10") == [0, 1, 2, 10]
    with pytest.raises(ValueError, match=r"layers \[30\] are out of range: .*\[0, 30\)"):
        check_layers([0, 29, 30], 30)


def test_import_structlm_registers_the_model_with_transformers(tmp_path) -> None:
    pytest.importorskip("transformers")
    from structlm.models import StructLMForCausalLM, config_from_preset

    StructLMForCausalLM(config_from_preset("tiny")).save_pretrained(tmp_path)
    code = ("import structlm\nfrom transformers import AutoModelForCausalLM\n"
            f"print(type(AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    assert out.stdout.strip().endswith("StructLMForCausalLM")


@pytest.mark.parametrize(("argv", "match"), [
    (["generate", "--prompt", "a", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "--prompt", "a", "--top-p", "2"], r"top-p must be in \(0, 1\]"),
    (["generate", "--prompt", "  "], "must not be empty"),
    (["generate", "--prompt", "a", "--max-new-tokens", "0"], "positive integer, got 0"),
    (["bench", "generate", "--modes", "bogus"], r"unknown modes \['bogus'\]"),
    (["bench", "generate", "--runs", "x"], "--runs: 'x' is not an integer"),
])
def test_generation_flags_are_checked_at_parse(argv: list[str], match: str, capsys) -> None:
    from structlm.cli import main

    with pytest.raises(SystemExit):
        main(argv)
    assert pytest.importorskip("re").search(match, capsys.readouterr().err)


def test_a_model_that_cannot_be_built_is_refused_by_cost(capsys) -> None:
    pytest.importorskip("transformers")
    from structlm.cli import main

    try:
        rc = main(["cost", "--preset", "tiny", "--algebra", "Q3"])
    except SystemExit as e:
        rc = e.code
    assert rc not in (0, None)
    assert ("q=3 equal groups: {'hidden_size': 32, 'intermediate_size': 64} not divisible "
            "by 3") in capsys.readouterr().err


@pytest.mark.parametrize("bad", [7.5, 0, True, "8"])
def test_algebra_linear_widths_must_be_positive_integers(bad: object) -> None:
    from structlm import AlgebraError, AlgebraLinear

    with pytest.raises(AlgebraError, match="in_features must be a positive integer"):
        AlgebraLinear(bad, 8, "Q2")  # type: ignore[arg-type]


def test_unknown_model_override_is_refused() -> None:
    pytest.importorskip("transformers")
    from structlm.train import TrainConfig

    with pytest.raises(ValueError, match=r"model_overrides: unknown keys \['hiden_size'\]"):
        TrainConfig(model_overrides={"hiden_size": 64})


def test_oversized_algebras_are_refused_before_building() -> None:
    from structlm import AlgebraError, get_algebra

    with pytest.raises(AlgebraError, match=r"q <= 256, got q=1024"):
        get_algebra("Q1024")
    with pytest.raises(AlgebraError, match="Q2\\^7: the tensor power would hold 279,936"):
        get_algebra("Q2^7")


def test_schedules_and_from_linear_refuse_bad_arguments() -> None:
    import torch

    from structlm import AlgebraLinear, CyclicSchedule

    with pytest.raises(ValueError, match="q >= 1 types, got q=0"):
        CyclicSchedule(0)
    with pytest.raises(TypeError, match=r"needs an nn\.Linear, got Conv1d"):
        AlgebraLinear.from_linear(torch.nn.Conv1d(4, 4, 1), "Q2")  # type: ignore[arg-type]


def test_generate_refuses_a_missing_model_and_a_too_long_request(tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    from structlm.cli import main

    def run(argv: list[str]) -> str:
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        assert rc not in (0, None)
        return capsys.readouterr().err

    assert "no saved model there" in run(["generate", "--model", str(tmp_path / "nope"),
                                          "--prompt", "hi"])
    assert "exceeds the model's context of 512 positions" in run(
        ["generate", "--preset", "cpu-small", "--prompt", "hi", "--max-new-tokens", "600"])


@pytest.mark.parametrize("argv", [["generate", "--preset", "tiny", "--prompt", "hi"],
                                  ["bench", "generate", "--preset", "study-cpu"]])
def test_presets_without_the_gpt2_vocabulary_are_refused_by_gpt2_commands(argv, capsys) -> None:
    pytest.importorskip("transformers")
    from structlm.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc not in (0, None)
    assert "tokenises with GPT-2 (50,257 tokens): use one of ['cpu-small', 'paper-110m']" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("widths", [[2.5, 5.5], [4.0, 4.0], [True, 7]])
def test_fractional_or_boolean_group_widths_are_refused_not_truncated(widths) -> None:
    from structlm import AlgebraLinear
    from structlm.algebra import AlgebraError

    with pytest.raises(AlgebraError, match=f"{widths[0]!r} is not an integer"):
        AlgebraLinear(8, 8, "Q2", group_sizes=(widths, [4, 4]))
    assert AlgebraLinear(8, 8, "Q2", group_sizes=([3, 5], [4, 4])).in_widths == (3, 5)
