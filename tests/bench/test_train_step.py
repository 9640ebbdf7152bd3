"""``structlm bench train``: the training-step benchmark runs both real models through
the real step, and its MAC ideal has the known value."""

from __future__ import annotations

import csv
from fractions import Fraction

import pytest

from structlm.bench.train_step import (
    PRESETS,
    TrainBenchConfig,
    run_train_bench,
    training_step_macs,
)
from structlm.cli import main
from structlm.models import StructLMForCausalLM, config_from_preset


def test_training_step_macs_known_answer() -> None:
    # study-tiny: D = 32, F = 128, V = 512, 2 layers; T = 64 under block:8 gives 16
    # positions of each Q2^2 type, rho = 9/16 (balanced)
    d, f, v, n, t = 32, 128, 512, 2, 64
    mean = Fraction(t + 1, 2)
    dense = StructLMForCausalLM(config_from_preset("study-tiny"))
    alg = StructLMForCausalLM(config_from_preset("study-tiny", "Q2^2", type_schedule="block:8"))
    attn = 4 * d * d + 2 * d * mean
    assert training_step_macs(dense, t) == 3 * (n * (attn + 3 * d * f) + d * v)
    assert training_step_macs(alg, t) == 3 * (n * (attn + 3 * d * f * Fraction(9, 16)) + d * v)


def test_tiny_bench_train_writes_rows(tmp_path) -> None:
    cfg = TrainBenchConfig(preset="study-tiny", seq_len=32, batch_size=1, trials=1, warmup=0)
    rows = run_train_bench([cfg], str(tmp_path / "t"), progress=False)
    assert len(rows) == 1 and rows[0]["type_schedule"] == "block:4"  # auto: T / (2q)
    assert rows[0]["dense_ms"] > 0 and rows[0]["algebra_ms"] > 0
    assert rows[0]["ideal"] == pytest.approx(rows[0]["dense_train_macs_per_token"]
                                             / rows[0]["algebra_train_macs_per_token"], 1e-3)
    with open(tmp_path / "t.csv") as fh:
        assert next(csv.DictReader(fh))["env_threads"]
    assert "% of ideal" in (tmp_path / "t.md").read_text()
    r = rows[0]  # the compute ceiling: achieved GFLOP/s against the GEMM rate of the run
    for arm in ("dense", "algebra"):
        flops = 2 * r[f"{arm}_train_macs_per_token"] * r["tokens_per_step"]
        assert r[f"{arm}_gflops"] == pytest.approx(flops / (r[f"{arm}_ms"] / 1e3) / 1e9,
                                                   rel=0.01, abs=0.01)
        assert r[f"{arm}_pct_of_peak"] == pytest.approx(
            100 * r[f"{arm}_gflops"] / r["gemm_peak_gflops"], abs=0.06)
    assert r["gemm_peak_gflops"] > 0 and "% of GEMM" in (tmp_path / "t.md").read_text()
    assert not (tmp_path / "t_profile.md").exists()  # profiling only when asked


def test_bench_train_profile_names_the_operators(tmp_path) -> None:
    cfg = TrainBenchConfig(preset="study-tiny", seq_len=32, batch_size=1, trials=1, warmup=0,
                           profile=True)
    rows = run_train_bench([cfg], str(tmp_path / "p"), progress=False)
    assert "profiles" not in rows[0]  # the tables go to their own file, not the CSV
    text = (tmp_path / "p_profile.md").read_text()
    assert ": dense (dense)" in text and ": algebra (Q2^2)" in text
    assert text.count("aten::mm") >= 2 and "Self CPU" in text  # each arm's operators


def test_bench_train_cli_and_bad_input(tmp_path, capsys) -> None:
    assert main(["bench", "train", "--preset", "tiny", "--trials", "1", "--warmup", "0",
                 "--out", str(tmp_path / "c")]) == 0
    assert "study-tiny" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # refused when the flag is parsed
        main(["bench", "train", "--preset", "tiny", "--seq-len", "0"])
    assert "--seq-len: 0 is out of range: expected >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="seq_len"):
        TrainBenchConfig(seq_len=0)
    assert {"paper-110m", "study-cpu"} <= set(PRESETS)


def test_training_step_grad_clip_zero_does_not_clip() -> None:
    """``grad_clip = 0`` is no clipping (it once zeroed every gradient): the step equals
    one under a clip that never binds, keeps non-zero gradients and moves every
    parameter, those without weight decay too."""
    import copy

    import torch

    from structlm.bench.train_step import training_step
    from structlm.train import TrainConfig, build_model, build_optimizer

    tc = TrainConfig(preset="study-tiny", algebra="Q2^2", seq_len=32, batch_size=2,
                     grad_clip=0.0, warmup_steps=0, lr=1e-3)
    model = build_model(tc).train()
    init = copy.deepcopy(model.state_dict())
    never = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 33),
                        generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    loss = training_step(model, build_optimizer(model, tc)[0], x, y, tc.grad_clip)
    ref = training_step(never, build_optimizer(never, tc)[0], x, y, 1e9)
    assert loss == ref and loss > 0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(bool(g.any()) for g in grads)
    for (name, a), b in zip(model.state_dict().items(), never.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
        assert not torch.equal(a, init[name]), f"{name} did not change"
    # a clip that binds does clip: the global norm ends at the clip
    training_step(model, build_optimizer(model, tc)[0], x, y, 1e-3)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                 if p.grad is not None]))
    assert float(norm) == pytest.approx(1e-3, rel=1e-3)
