"""The one config layer: YAML files and values checked and coerced by type, with errors
that name the file, key, value and expected type."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Annotated

import pytest

from structlm.cli.dataclass_flags import add_dataclass_flags
from structlm.config import (
    ConfigError,
    Distinct,
    NonEmpty,
    OneOf,
    Range,
    coerce,
    dataclass_from_dict,
    read_yaml,
    validated,
)


@dataclasses.dataclass
class _Cfg:
    lr: float = 1e-3
    steps: int = 10
    flag: bool = False
    name: str = "x"
    width: int | str = "preset"
    seeds: tuple[int, ...] = (0,)
    extra: dict[str, float] = dataclasses.field(default_factory=dict)
    maybe: int | None = None


def test_values_are_coerced_by_their_types() -> None:
    cfg = dataclass_from_dict(_Cfg, {"lr": "3e-4", "steps": 10.0, "flag": "true", "width": 576,
                                     "seeds": [0, "1"], "extra": {"a": 1}, "maybe": None})
    assert cfg == _Cfg(lr=3e-4, steps=10, flag=True, width=576, seeds=(0, 1),
                       extra={"a": 1.0}, maybe=None)
    assert dataclass_from_dict(_Cfg, {"width": "mac-match:Q4"}).width == "mac-match:Q4"


@pytest.mark.parametrize(("raw", "match"), [
    ({"lr": "fast"}, r"lr: 'fast' is not a number \(in _Cfg\)"),
    ({"steps": 2.5}, "steps: 2.5 is not an integer"),
    ({"steps": True}, "steps: True is not an integer"),
    ({"flag": 1}, "flag: 1 is not a boolean"),
    ({"seeds": "0,1"}, r"seeds: '0,1' is not a list"),
    ({"seeds": [0, "x"]}, r"seeds\[1\]: 'x' is not an integer"),
    ({"extra": [1]}, "extra: \\[1\\] is not a mapping"),
    ({"maybe": "many"}, "maybe: 'many' is not int or NoneType"),
    ({"lr ": 1}, r"unknown _Cfg keys \['lr '\]"),
])
def test_bad_values_name_key_value_and_type(raw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        dataclass_from_dict(_Cfg, raw, where="f.yaml")
    assert coerce(float("inf"), float, "x") == float("inf")


def test_yaml_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        read_yaml(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: [1, 2\nsteps: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML at line \d+, column \d+"):
        read_yaml(str(bad))
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping of config keys, got list"):
        read_yaml(str(listed))
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert read_yaml(str(empty)) == {}
    for text, where in (("lr: 0.001\nsteps: 3\nlr: 0.1\n", "line 3, column 1"),
                        ("outer:\n  a: 1\n  a: 2\n", "line 3, column 3")):
        dup = tmp_path / "dup.yaml"
        dup.write_text(text)  # plain PyYAML would keep the last value without a word
        with pytest.raises(ConfigError, match=f"at {where}: duplicate key"):
            read_yaml(str(dup))


def test_a_range_with_one_more_valid_value() -> None:
    """``grad_clip``: 0 is "off", tiny positive norms would stop every Adam update."""
    from structlm.train import TrainConfig

    assert TrainConfig(grad_clip=0).grad_clip == 0 and TrainConfig(grad_clip=1e-6)
    for bad in (1e-12, -1.0, float("nan")):
        with pytest.raises(ConfigError, match=re.escape(
                "expected >= 1e-06, or 0 (0: no clipping)")):
            TrainConfig(grad_clip=bad)


def test_train_config_yaml_reads_exponents_and_refuses_nonpositive_counts(tmp_path) -> None:
    pytest.importorskip("transformers")
    from structlm.train import load_config

    path = tmp_path / "t.yaml"
    path.write_text("lr: 3e-4\nmax_steps: 5\n")
    assert load_config(str(path)).lr == 3e-4
    for key, value in (("max_steps", 0), ("eval_every", -1), ("save_every", 0),
                       ("grad_accum", 0), ("threads", 0), ("batch_size", 0)):
        path.write_text(f"{key}: {value}\n")
        with pytest.raises(ValueError, match=f"{key}: {value} is out of range: expected >= 1"):
            load_config(str(path))
    path.write_text("batch_size: 2.5\n")
    with pytest.raises(ValueError, match=r"batch_size: 2\.5 is not an integer"):
        load_config(str(path))


def test_partial_nested_mapping_keeps_the_fields_own_default() -> None:
    """``seed_finetune: {lr: 0.1}`` changes the rate of the seed regime's 300-step default,
    not the plain FinetuneConfig's 60 steps (a silent change before)."""
    from structlm.experiments.share.experiment import ExperimentConfig

    cfg = ExperimentConfig.from_dict({"seed_finetune": {"lr": 0.1}, "finetune": {"steps": 9}})
    assert (cfg.seed_finetune.steps, cfg.seed_finetune.warmup, cfg.seed_finetune.lr) == (
        300, 15, 0.1)
    assert (cfg.finetune.steps, cfg.finetune.warmup) == (9, 5)


def test_ranges_written_next_to_a_field_are_checked_by_yaml_flags_and_api() -> None:
    """One mechanism: ``Annotated[T, Range(...) | OneOf(...) | Distinct() | NonEmpty()]``
    is checked when a YAML mapping is read, when a flag is parsed and when the dataclass
    is built in Python, with the key, the value and the valid range in the message."""
    @dataclasses.dataclass
    @validated
    class Cfg:
        lr: Annotated[float, Range(gt=0)] = 1e-3
        """Rate."""
        clip: Annotated[float, Range(ge=0, note="0: no clipping")] = 1.0
        mode: Annotated[str, OneOf("relative", "absolute")] = "relative"
        seeds: Annotated[list[int], Distinct(), NonEmpty()] = dataclasses.field(
            default_factory=lambda: [0])

    assert Cfg(lr="0.5").lr == 0.5  # coerced like a YAML value
    bad = {"lr": (-1, "lr: -1.0 is out of range: expected > 0"),
           "clip": (float("nan"), "expected >= 0 (0: no clipping)"),
           "mode": ("abs", "expected one of 'relative', 'absolute'"),
           "seeds": ([0, 0], "repeats [0]")}
    for key, (value, msg) in bad.items():
        with pytest.raises(ConfigError, match=re.escape(msg)):
            Cfg(**{key: value})
        with pytest.raises(ConfigError, match=re.escape(msg)):
            dataclass_from_dict(Cfg, {key: value})
    with pytest.raises(ConfigError, match="seeds: \\[\\] is empty"):
        Cfg(seeds=[])
    parser = argparse.ArgumentParser(exit_on_error=False)
    flags = add_dataclass_flags(parser, Cfg)
    assert flags.values(parser.parse_args(["--lr", "2e-3"])) == {"lr": 2e-3}
    for argv in (["--lr", "0"], ["--seeds", "1,1"], ["--mode", "x"]):
        with pytest.raises(argparse.ArgumentError):
            parser.parse_args(argv)
    assert "Valid: > 0." in parser.format_help()
