"""CLI flags derived from the config dataclasses: one flag per field, help from the
field's docstring, values parsed by the config layer, only given flags override."""

from __future__ import annotations

import dataclasses

import pytest

from structlm.cli import build_parser
from structlm.cli.dataclass_flags import add_dataclass_flags, field_docs
from structlm.cli.experiment import share_experiment_config


@dataclasses.dataclass
class _Example:
    steps: int = 3
    """Optimiser steps."""
    lr: float = 1e-3
    """Peak rate (``lr``, see :mod:`.x`)."""
    seeds: list[int] = dataclasses.field(default_factory=lambda: [0])
    layer: int | None = None
    update: bool = False
    ranks: dict[str, int] = dataclasses.field(default_factory=dict)


def _parse(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser(prog="x", exit_on_error=False)
    flags = add_dataclass_flags(parser, _Example, prefix="ft")
    return parser, flags, flags.values(parser.parse_args(argv))


def test_flags_cover_fields_and_parse_like_the_config_layer() -> None:
    parser, flags, given = _parse(["--ft-lr", "3e-4", "--ft-seeds", "0,1,2", "--ft-layer",
                                   "none", "--ft-update"])
    assert given == {"lr": 3e-4, "seeds": [0, 1, 2], "layer": None, "update": True}
    assert set(flags.dests) == {"steps", "lr", "seeds", "layer", "update"}  # no mapping flag
    assert _parse(["--no-ft-update", "--ft-steps", "7"])[2] == {"update": False, "steps": 7}
    assert _parse([])[2] == {}  # nothing given: the YAML decides
    text = parser.format_help()
    assert "Optimiser steps. (default: 3)" in text
    assert "Peak rate (lr, see x). (default: 0.001)" in " ".join(text.split())


@pytest.mark.parametrize("argv, needle", [
    (["--ft-steps", "2.5"], "argument --ft-steps: '2.5' is not an integer"),
    (["--ft-seeds", "0,a"], "argument --ft-seeds: item 2: 'a' is not an integer"),
    (["--ft-lr", "fast"], "argument --ft-lr: 'fast' is not a number")])
def test_bad_flag_values_name_the_flag(argv: list[str], needle: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentError) as err:
        _parse(argv)
    assert str(err.value) == needle


def test_every_config_field_of_the_commands_is_documented() -> None:
    from structlm.bench.generate import GenerateBenchConfig
    from structlm.bench.layer import LayerBenchConfig
    from structlm.bench.share import ShareBenchConfig
    from structlm.bench.train_step import TrainBenchConfig
    from structlm.experiments.share.experiment import ExperimentConfig
    from structlm.hf.finetune import FinetuneConfig
    from structlm.share.analysis.analyze import AnalysisConfig
    from structlm.share.compress import CompressionConfig
    from structlm.train.loop import TrainConfig

    for cls in (AnalysisConfig, CompressionConfig, FinetuneConfig, ExperimentConfig,
                ShareBenchConfig, TrainConfig, LayerBenchConfig, GenerateBenchConfig,
                TrainBenchConfig):
        docs = field_docs(cls)
        bare = [f.name for f in dataclasses.fields(cls)
                if f.name not in docs and f.name not in ("model", "thresholds", "extra")]
        assert not bare, f"{cls.__name__} fields without a docstring (no --help text): {bare}"


def test_experiment_flags_override_the_yaml_and_its_nested_finetune(tmp_path) -> None:
    cfg_file = tmp_path / "e.yaml"
    cfg_file.write_text("seeds: [0, 1, 2]\nfinetune: {steps: 100, lr: 0.002}\n")
    args = build_parser().parse_args(
        ["experiment", "share", "smollm2", "--config", str(cfg_file), "--seeds", "4,5",
         "--reductions", "0.3", "--finetune-steps", "7", "--seed-finetune-warmup", "2",
         "--no-scope"])
    cfg = share_experiment_config(args)
    assert cfg.seeds == [4, 5] and cfg.reductions == [0.3] and cfg.scope is False
    assert (cfg.finetune.steps, cfg.finetune.lr) == (7, 0.002)  # the YAML's lr is kept
    assert cfg.seed_finetune.warmup == 2 and cfg.seed_finetune.steps == 300


def test_train_flags_reach_the_train_config() -> None:
    args = build_parser().parse_args(["train", "configs/cpu-small-dense.yaml", "--lr", "3e-4",
                                      "--max-steps", "5"])
    assert args.flags.values(args) == {"lr": 3e-4, "max_steps": 5}


def test_bench_flags_keep_their_spellings_and_checks() -> None:
    args = build_parser().parse_args(["bench", "layer", "--preset", "small", "--m", "1,7",
                                      "--shapes", "97x1025", "--algebras", "Q4,Q2^2"])
    assert args.flags.values(args) == {"ms": (1, 7), "shapes": ((97, 1025),),
                                       "algebras": ("Q4", "Q2^2")}
    args = build_parser().parse_args(["bench", "generate", "--max-new-tokens", "5", "--modes",
                                      "fixed", "--prompt", "a, b"])
    assert args.flags.values(args) == {"max_new_tokens": 5, "modes": ("fixed",)}
    assert args.prompt == ["a, b"]  # prompts are not split on commas
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "generate", "--runs", "0"])
