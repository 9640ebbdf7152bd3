"""Experiment run folders: one writer each, never over an input model, and a plan whose
conversions cannot run is refused from the architecture before the first arm."""

from __future__ import annotations

import fcntl

import pytest

pytest.importorskip("transformers")

from structlm.convert import AlgebraConfig, check_convertible
from structlm.experiments.convert.experiment import (
    ConvertExperimentConfig,
    run_convert_experiment,
)
from structlm.experiments.share.experiment import ExperimentConfig, run_experiment
from tiny_models import tiny_llama

RUNNERS = {
    "share": lambda model, out: run_experiment(ExperimentConfig(model=model), out,
                                               progress=False),
    "convert": lambda model, out: run_convert_experiment(
        ConvertExperimentConfig(model=model), out, progress=False),
}


def _files(folder):
    return sorted((p.relative_to(folder), p.read_bytes()) for p in folder.rglob("*")
                  if p.is_file())


@pytest.mark.parametrize("kind", sorted(RUNNERS))
def test_an_experiment_folder_over_its_input_model_is_refused(kind: str, tmp_path) -> None:
    model = tmp_path / "model"
    tiny_llama().save_pretrained(model)
    before = _files(model)
    for out in (model, model / "report", tmp_path):
        with pytest.raises(ValueError, match="overlaps the input"):
            RUNNERS[kind](str(model), out)
    assert _files(model) == before


@pytest.mark.parametrize("kind", sorted(RUNNERS))
def test_a_second_writer_of_an_experiment_folder_is_refused(kind: str, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        with pytest.raises(RuntimeError, match="being written by another process"):
            RUNNERS[kind]("smollm2", out)
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_check_convertible_names_what_convert_would_refuse_and_changes_nothing() -> None:
    model = tiny_llama()  # hidden 32, FFN 48, 3 layers
    names = check_convertible(model, AlgebraConfig("Q4", "cyclic", "mlp"))
    assert len(names) == 9 and all("mlp" in n for n in names)
    assert all(type(m).__name__ == "Linear" for n, m in model.named_modules() if n in names)
    with pytest.raises(ValueError, match="not divisible by q=7 of Q7"):
        check_convertible(model, AlgebraConfig("Q7", "cyclic", "mlp"))


def test_a_convert_plan_that_cannot_run_is_refused_before_the_first_arm(tmp_path) -> None:
    model = tmp_path / "model"
    tiny_llama().save_pretrained(model)
    cfg = ConvertExperimentConfig(model=str(model), algebras=["Q2^2", "Q7"])
    with pytest.raises(ValueError, match="algebra 'Q7' on target 'mlp'"):
        run_convert_experiment(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "config.json").exists()
