"""``grad_clip: 0`` turns clipping off (it once zeroed every gradient); a negative clip
is refused at config load."""

from __future__ import annotations

import csv

import pytest
import torch

pytest.importorskip("transformers")

from structlm.config import ConfigError
from structlm.train import TrainConfig, build_model, clip_gradients, load_config, train


def _cfg(out: str, data: str, grad_clip: float) -> TrainConfig:
    # the tiny built-in setup of test_loop.py, evaluated every step on fixed windows
    return TrainConfig(out_dir=out, data_dir=data, preset="tiny", algebra="Q2^2",
                       type_schedule="block:8", model_overrides={"vocab_size": 50257},
                       corpus="bible", seq_len=32, batch_size=4, max_steps=4, lr=3e-3,
                       warmup_steps=0, eval_every=1, eval_batches=2, save_every=4,
                       grad_clip=grad_clip)


def _rows(path) -> list[dict[str, str]]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(open(path))]


def test_grad_clip_zero_trains_unclipped(tmp_path) -> None:
    from safetensors.torch import load_file

    data = str(tmp_path / "tokens")
    off = _cfg(str(tmp_path / "off"), data, 0.0)
    rows = _rows(train(off, progress=False))
    val = [float(r["val_loss"]) for r in rows]
    assert len(val) == 4 and val == sorted(val, reverse=True) and val[-1] < val[0] - 0.05, val
    # the same curve as a clip that never binds (zeroed gradients would leave it flat)
    never = _cfg(str(tmp_path / "never"), data, 1e9)
    assert _rows(train(never, progress=False)) == rows
    # every parameter moved, also those without weight decay (which zeroed gradients
    # leave exactly where they started)
    init = build_model(off).state_dict()
    trained = load_file(str(tmp_path / "off" / "checkpoint" / "model.safetensors"))
    assert trained and set(trained) <= set(init)
    for name, value in trained.items():
        assert not torch.equal(value, init[name]), f"{name} did not change"


def test_clip_gradients_zero_is_a_no_op_and_positive_clips() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    clip_gradients([p], 0.0)
    assert torch.equal(p.grad, torch.tensor([3.0, 4.0, 0.0]))
    clip_gradients([p], 1.0)
    assert float(p.grad.norm()) == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("value", ["-1", "-0.5", ".nan"])
def test_negative_grad_clip_is_refused(tmp_path, value: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"grad_clip: {value}\n")
    with pytest.raises(ConfigError, match=r"grad_clip: .* is out of range: expected >= 1e-06, "
                                          r"or 0 \(0: no clipping\)"):
        load_config(str(bad))
    ok = tmp_path / "ok.yaml"
    ok.write_text("grad_clip: 0\n")
    assert load_config(str(ok)).grad_clip == 0.0


def test_negative_grad_clip_message_names_the_value(tmp_path, capsys) -> None:
    from structlm.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"out_dir: {tmp_path / 'run'}\ngrad_clip: -1\n")
    assert main(["train", str(bad)]) == 2
    assert ("grad_clip: -1.0 is out of range: expected >= 1e-06, or 0 (0: no clipping)"
            in capsys.readouterr().err)
    assert not (tmp_path / "run").exists()
