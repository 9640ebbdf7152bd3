"""Every config field carries its valid range (``Annotated[T, Range(...)]`` and friends):
each bad value of the reliability issue is refused through the real loader, the real
flags or the Python API — at load, flag parse or construction, before any work — with a
message that names the key (or flag) and the value."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from structlm.cli import main
from structlm.config import ConfigError
from tiny_models import tiny_llama

pytest.importorskip("transformers")


def _refused(argv: list[str], capsys: Any, *needles: str) -> str:
    """``structlm ARGV`` stops with status 2 and an error naming every needle (a flag
    refused by argparse exits with 2 as it is parsed; a config refused when it is built
    makes ``main`` return 2 with ``structlm: error: ...``)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "error:" in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    return err


@pytest.fixture(scope="module")
def models(tmp_path_factory: Any) -> dict[str, str]:
    """Saved tiny models: ``three`` (3 layers, 64 positions) and ``two`` (2 layers)."""
    root = tmp_path_factory.mktemp("models")
    tiny_llama().save_pretrained(root / "three")
    tiny_llama(num_hidden_layers=2).save_pretrained(root / "two")
    return {"three": str(root / "three"), "two": str(root / "two")}


# ------------------------------------------------------------------ TrainConfig (YAML)
TRAIN_YAML = [
    ("grad_clip: -1", "grad_clip: -1.0 is out of range: expected >= 1e-06, or 0 (0: no clipping)"),
    ("weight_decay: -1", "weight_decay: -1.0 is out of range: expected >= 0"),
    ("warmup_steps: -5", "warmup_steps: -5 is out of range: expected >= 0"),
    ("min_lr_ratio: -1", "min_lr_ratio: -1.0 is out of range: expected >= 0 and <= 1"),
    ("min_lr_ratio: 5", "min_lr_ratio: 5.0 is out of range: expected >= 0 and <= 1"),
    ("model_overrides: {num_hidden_layers: 0}",
     "model_overrides.num_hidden_layers: 0 is out of range: expected >= 1"),
    ("model_overrides: {num_hidden_layers: -1}",
     "model_overrides.num_hidden_layers: -1 is out of range: expected >= 1"),
    ("model_overrides: {hidden_size: abc}", "model_overrides.hidden_size: 'abc' is not an integer"),
    ("model_overrides: {num_attention_heads: 0}",
     "model_overrides.num_attention_heads: 0 is out of range: expected >= 1"),
    ("model_overrides: {intermediate_size: 0}",
     "model_overrides.intermediate_size: 0 is out of range: expected >= 1"),
    ("model_overrides: {initializer_range: .nan}",
     "model_overrides.initializer_range: nan is out of range: expected > 0"),
    ("model_overrides: {tie_word_embeddings: 'no'}",
     "model_overrides.tie_word_embeddings: 'no' is not a boolean"),
    ("model_overrides: {algebra: Q4}", "model_overrides: ['algebra'] are TrainConfig fields"),
    ("model_overrides: {type_schedule: cyclic}",
     "model_overrides: ['type_schedule'] are TrainConfig fields"),
    ("model_overrides: {n_positions: 64}\nseq_len: 100",
     "seq_len: 100 is beyond the model's context of 64 positions"),
    ("type_schedule: bogus", "type_schedule: unknown schedule 'bogus'"),
    ("out_dir: ''", "out_dir: '' is empty"),
    ("out_dir: FILE", "is an existing file, not a folder"),
]


@pytest.mark.parametrize(("yaml", "message"), TRAIN_YAML)
def test_train_yaml_out_of_range_is_refused_at_load(yaml: str, message: str, tmp_path: Path,
                                                    capsys: Any) -> None:
    from structlm.train import load_config

    file = tmp_path / "a-file"
    file.write_text("not a folder")
    path = tmp_path / "c.yaml"
    out = "" if yaml.startswith("out_dir") else f"out_dir: {tmp_path / 'run'}\n"
    path.write_text(out + yaml.replace("FILE", str(file)) + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert message in str(e.value)
    _refused(["train", str(path)], capsys, message)
    assert not (tmp_path / "run").exists()


def test_train_grad_clip_takes_zero_or_a_usable_norm(tmp_path: Path) -> None:
    from structlm.config import ConfigError
    from structlm.train import TrainConfig, load_config

    path = tmp_path / "c.yaml"
    path.write_text(f"out_dir: {tmp_path / 'run'}\ngrad_clip: 1e-12\n")
    with pytest.raises(ConfigError, match="expected >= 1e-06, or 0"):
        load_config(str(path))  # every Adam update would vanish
    for value in ("0", "1e-6", "0.5"):
        path.write_text(f"out_dir: {tmp_path / 'run'}\ngrad_clip: {value}\n")
        assert load_config(str(path)).grad_clip == float(value)
    assert TrainConfig(model_overrides={"hidden_size": "128"}).model_overrides == {
        "hidden_size": 128}  # coerced like a YAML value


@pytest.mark.parametrize(("flag", "value"), [("--weight-decay", "-1"), ("--warmup-steps", "-5"),
                                             ("--min-lr-ratio", "5"), ("--grad-clip", "nan"),
                                             ("--threads", "0"), ("--out-dir", "")])
def test_train_flags_out_of_range_are_refused_when_parsed(flag: str, value: str,
                                                          tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"out_dir: {tmp_path / 'run'}\n")
    _refused(["train", str(path), flag, value], capsys, f"argument {flag}")


def test_help_states_the_valid_range(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Valid: >= 1e-06, or 0 (0: no clipping)." in out
    assert "Valid: >= 0 and <= 1." in out


# ------------------------------------------------------------------ share analyze / compress
@pytest.mark.parametrize("extra", [
    ["--energy", "0"], ["--energy", "1.5"], ["--permutations", "0"], ["--batch-size", "0"],
    ["--eig-floor", "-1"], ["--eval-fraction", "0"], ["--eval-fraction", "1"],
    ["--threads", "0"], ["--seq-len", "1"], ["--k-fraction", "1"], ["--layers", "1,1"]])
def test_share_analyze_flags_are_refused_when_parsed(extra: list[str], capsys: Any) -> None:
    _refused(["share", "analyze", "x", *extra], capsys, f"argument {extra[0]}")


def test_share_analyze_seq_len_beyond_the_context_is_refused_before_work(
        models: dict[str, str], tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "an"
    _refused(["share", "analyze", models["three"], "--seq-len", "100", "--out", str(out)],
             capsys, "structlm: error: seq_len: 100 is beyond the context", "64 positions")
    assert not out.exists()
    _refused(["share", "analyze", models["three"], "--layers", "0,1,5", "--seq-len", "64",
              "--out", str(out)], capsys, "layers: [5] are out of range")
    assert not out.exists()


@pytest.mark.parametrize("extra", [
    ["--finetune-steps", "-1"], ["--finetune-warmup", "-3"], ["--finetune-batch-size", "0"],
    ["--finetune-seq-len", "0"], ["--finetune-lr", "nan"], ["--eig-floor", "-1"],
    ["--group-size", "1.5"], ["--group-size", "0"], ["--target-reduction", "1"],
    ["--budget", "pooled"], ["--threads", "0"]])
def test_share_compress_flags_are_refused_when_parsed(extra: list[str], capsys: Any) -> None:
    _refused(["share", "compress", "x", *extra], capsys, f"argument {extra[0]}")


@pytest.mark.parametrize(("yaml", "message"), [
    ("finetune: [1, 2]", "finetune: [1, 2] is not a mapping of FinetuneConfig keys"),
    ("finetune: {batch_size: 0}", "batch_size: 0 is out of range"),
    ("group_size: 1.5", "group_size: 1.5 is not an integer"),
    ("types: bogus", "types: "),
])
def test_share_compress_yaml_is_refused_at_load(yaml: str, message: str, tmp_path: Path,
                                                capsys: Any) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml + "\n")
    _refused(["share", "compress", "x", "--config", str(path), "--out", str(tmp_path / "o")],
             capsys, "structlm: error:", message)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("method", ["basis-sharing", "shared"])
def test_share_compress_group_size_beyond_the_layers_is_refused_before_work(
        method: str, models: dict[str, str], tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "cp"
    _refused(["share", "compress", models["two"], "--method", method, "--group-size", "100",
              "--out", str(out)], capsys,
             "structlm: error: group_size: 100 is more than the model's 2 layers")
    assert not out.exists()


# ------------------------------------------------------------------ experiments
@pytest.mark.parametrize("extra", [
    ["--budget-tolerance", "-1"], ["--seeds", "0,0"], ["--reductions", "0.4,0.4"],
    ["--reductions", "0"], ["--methods", ""], ["--scope-reduction", "1.5"],
    ["--finetune-lr", "nan"], ["--seed-finetune-steps", "-1"], ["--group-size", "1.5"],
    ["--threads", "0"]])
def test_share_experiment_flags_are_refused_when_parsed(extra: list[str], tmp_path: Path,
                                                        capsys: Any) -> None:
    _refused(["experiment", "share", "x", *extra, "--out", str(tmp_path / "o")], capsys,
             f"argument {extra[0]}")


@pytest.mark.parametrize(("extra", "message"), [
    (["--types", "bogus"], "types: "),
    (["--seed-methods", "svd-llm-w,shared"],
     "seed_methods: ['svd-llm-w', 'shared'] must start with"),
    (["--methods", "pca"], "methods: unknown methods ['pca']")])
def test_share_experiment_config_is_refused_when_built(extra: list[str], message: str,
                                                       tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "o"
    _refused(["experiment", "share", "x", *extra, "--out", str(out)], capsys,
             "structlm: error:", message)
    assert not out.exists()


@pytest.mark.parametrize("extra", [
    ["--mac-tolerance", "-1"], ["--algebras", "Q2^2,Q2^2"], ["--targets", ""],
    ["--targets", "ffn"], ["--heal-lr", "nan"], ["--seeds", "1,1"], ["--baselines", "pca"],
    ["--threads", "0"]])
def test_convert_experiment_flags_are_refused_when_parsed(extra: list[str], tmp_path: Path,
                                                          capsys: Any) -> None:
    _refused(["experiment", "convert", "x", *extra, "--out", str(tmp_path / "o")], capsys,
             f"argument {extra[0]}")


def test_convert_experiment_baseline_that_would_be_dropped_is_refused(tmp_path: Path,
                                                                      capsys: Any) -> None:
    out = tmp_path / "o"
    _refused(["experiment", "convert", "x", "--baselines", "prune", "--targets", "attn",
              "--out", str(out)], capsys,
             "structlm: error: baselines: ['prune'] would run no arm",
             "applies to target mlp only")
    assert not out.exists()
    from structlm.experiments.convert.experiment import ConvertExperimentConfig

    # svd still runs on attn: prune is skipped there, as documented
    assert ConvertExperimentConfig(targets=["attn"]).baselines == ["prune", "svd"]


def test_convert_flags_are_refused_when_parsed(tmp_path: Path, capsys: Any) -> None:
    for extra in (["--heal-lr", "nan"], ["--heal-steps", "-1"], ["--eval-tokens", "-1"],
                  ["--threads", "0"]):
        _refused(["convert", "x", "--out", str(tmp_path / "o"), *extra], capsys,
                 f"argument {extra[0]}")


def test_study_flags_are_refused_when_parsed(tmp_path: Path, capsys: Any) -> None:
    for extra in (["--threads", "0"], ["--max-steps", "0"]):
        _refused(["experiment", "study", "c.yaml", *extra], capsys, f"argument {extra[0]}")


# ------------------------------------------------------------------ other commands
@pytest.mark.parametrize("algebra", ["Q2^2", "dense"])
def test_cost_refuses_an_unknown_schedule(algebra: str, capsys: Any) -> None:
    _refused(["cost", "--algebra", algebra, "--schedule", "bogus"], capsys,
             "structlm: error: --schedule: unknown schedule 'bogus'")


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "a", "--threads", "0"], ["routes", "x", "--threads", "0"],
    ["routes", "x", "--decode-steps", "-1"], ["eval", "ppl", "x", "--threads", "0"],
    ["bench", "layer", "--threads", "0"], ["bench", "generate", "--threads", "0"],
    ["bench", "generate", "--runs", "1"], ["bench", "train", "--threads", "0"],
    ["bench", "share", "--threads", "0"], ["bench", "share", "--batches", "1,1"],
    ["bench", "layer", "--m", "0"], ["bench", "layer", "--modes", "sideways"]])
def test_thread_counts_and_bench_fields_are_refused_when_parsed(argv: list[str],
                                                                capsys: Any) -> None:
    _refused(argv, capsys, "argument --")


@pytest.mark.parametrize("extra", [
    ["--batch-size", "0"], ["--window", "1"], ["--tokens", "0"], ["--eval-fraction", "0"],
    ["--eval-fraction", "1"], ["--stride", "0"]])
def test_eval_ppl_flags_are_refused_when_parsed(extra: list[str], capsys: Any) -> None:
    _refused(["eval", "ppl", "x", *extra], capsys, f"argument {extra[0]}")


def test_eval_ppl_window_beyond_the_context_is_refused_after_loading(
        models: dict[str, str], capsys: Any) -> None:
    _refused(["eval", "ppl", models["three"], "--window", "100"], capsys,
             "structlm: error: --window 100 is beyond the context", "64 positions")


# ------------------------------------------------------------------ the Python API
def _api_cases() -> list[Any]:
    from structlm.bench.generate import GenerateBenchConfig
    from structlm.bench.layer import LayerBenchConfig
    from structlm.bench.share import ShareBenchConfig
    from structlm.bench.train_step import TrainBenchConfig
    from structlm.convert.save import ConvertConfig
    from structlm.experiments.convert.experiment import ConvertExperimentConfig
    from structlm.experiments.share.experiment import ExperimentConfig
    from structlm.experiments.study.config import ArmSpec, StudyConfig
    from structlm.hf.finetune import FinetuneConfig
    from structlm.models import StructLMConfig
    from structlm.share.analysis.analyze import AnalysisConfig, Thresholds
    from structlm.share.compress import BasisSharingOptions, CompressionConfig, HybridOptions
    from structlm.train import TrainConfig

    nan = math.nan
    return [
        (TrainConfig, {"grad_clip": -1}, "grad_clip: -1"),
        (TrainConfig, {"beta2": 1.0}, "beta2: 1.0 is out of range"),
        (TrainConfig, {"preset": "huge"}, "preset: 'huge' is not valid"),
        (TrainConfig, {"model_overrides": {"pad_token_id": -1}},
         "model_overrides.pad_token_id: -1 is out of range: expected >= 0"),
        (StructLMConfig, {"num_hidden_layers": 0}, "num_hidden_layers: 0 is out of range"),
        (StructLMConfig, {"layer_norm_epsilon": 0}, "layer_norm_epsilon: 0"),
        (FinetuneConfig, {"lr": nan}, "lr: nan is out of range: expected > 0"),
        (FinetuneConfig, {"eval_window": 1}, "eval_window: 1 is out of range"),
        (AnalysisConfig, {"energy": 0}, "energy: 0"),
        (AnalysisConfig, {"permutations": 0}, "permutations: 0"),
        (AnalysisConfig, {"layers": [0, 1]}, "layers: [0, 1] holds fewer than 3"),
        (AnalysisConfig, {"layers": [0, 1, 2], "reference_layer": 5},
         "reference_layer: 5 is not among"),
        (AnalysisConfig, {"sink_tokens": 512}, "sink_tokens: 512 must be below seq_len"),
        (AnalysisConfig, {"types": "bogus"}, "types: "),
        (AnalysisConfig, {"thresholds": [1]}, "thresholds: [1] is not a mapping"),
        (Thresholds, {"classifier_max_p": 0}, "classifier_max_p: 0"),
        (BasisSharingOptions, {"group_size": 1.5}, "group_size: 1.5 is not an integer"),
        (CompressionConfig, {"basis_sharing": {"group_size": 0}}, "group_size: 0 is out of"),
        (CompressionConfig, {"eig_floor": -1}, "eig_floor: -1"),
        (CompressionConfig, {"k_fraction": 0}, "k_fraction: 0"),
        (HybridOptions, {"residual_rank": -1}, "residual_rank: -1"),
        (ExperimentConfig, {"seeds": [0, 0]}, "seeds: [0, 0] repeats [0]"),
        (ExperimentConfig, {"methods": []}, "methods: [] is empty"),
        (ExperimentConfig, {"reductions": [0.4, 0.4]}, "reductions: [0.4, 0.4] repeats"),
        (ExperimentConfig, {"scope_reduction": 1.5}, "scope_reduction: 1.5"),
        (ExperimentConfig, {"budget_tolerance": -1}, "budget_tolerance: -1"),
        (ExperimentConfig, {"group_size": 1.5}, "group_size: 1.5 is not an integer"),
        (ExperimentConfig, {"finetune": [1, 2]}, "finetune: [1, 2] is not a mapping"),
        (ConvertExperimentConfig, {"algebras": ["Q2^2", "Q2^2"]}, "algebras: ['Q2^2', 'Q2^2']"),
        (ConvertExperimentConfig, {"targets": []}, "targets: [] is empty"),
        (ConvertExperimentConfig, {"baselines": ["prune"], "targets": ["attn"]},
         "baselines: ['prune'] would run no arm"),
        (ConvertExperimentConfig, {"mac_tolerance": -1}, "mac_tolerance: -1"),
        (ConvertExperimentConfig, {"heal": FinetuneConfig(steps=0)}, "heal.steps: 0"),
        (ConvertConfig, {"model": ""}, "model: '' is empty"),
        (ConvertConfig, {"model": "x", "seed": -1}, "seed: -1"),
        (ArmSpec, {"name": "a", "seeds": (0, 0)}, "seeds: [0, 0] repeats"),
        (ArmSpec, {"name": "a", "ffn": 0}, "ffn width 0 must be >= 1"),
        (StudyConfig, {"out_dir": "s", "arms": ()}, "arms: () is empty"),
        (StudyConfig, {"out_dir": "s", "arms": (ArmSpec("a"),), "generation_runs": 1},
         "generation_runs: 1"),
        (LayerBenchConfig, {"ms": (0,)}, "ms[0]: 0 is out of range"),
        (LayerBenchConfig, {"flush_max_m": -1}, "flush_max_m: -1"),
        (GenerateBenchConfig, {"runs": 1}, "runs: 1 is out of range: expected >= 2"),
        (TrainBenchConfig, {"seq_len": 0}, "seq_len: 0 is out of range"),
        (TrainBenchConfig, {"seq_len": 4096}, "seq_len: 4096 is beyond the context"),
        (ShareBenchConfig, {"batches": (1, 1)}, "batches: [1, 1] repeats"),
        (ShareBenchConfig, {"target_reduction": 1}, "target_reduction: 1"),
    ]


@pytest.mark.parametrize("case", range(len(_api_cases())))
def test_api_construction_refuses_out_of_range_values(case: int) -> None:
    cls, kwargs, message = _api_cases()[case]
    with pytest.raises(ConfigError) as e:
        cls(**kwargs)
    assert message in str(e.value)
