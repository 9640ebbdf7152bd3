"""The training loop: configs parse, loss is finite and falls, resume is exact."""

from __future__ import annotations

import csv
import glob
import os

import pytest

pytest.importorskip("transformers")

from structlm.train import TrainConfig, load_config, train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_every_config_parses(path: str) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig) and cfg.max_steps > 0


def test_unknown_key_is_an_error(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("algebra: Q4\nlearning_rate: 1\n")
    with pytest.raises(ValueError, match=r"unknown TrainConfig keys \['learning_rate'\]"):
        load_config(str(bad))


def _cfg(out: str, data: str) -> TrainConfig:
    return TrainConfig(out_dir=out, data_dir=data, preset="tiny", algebra="Q2^2",
                       type_schedule="block:8", model_overrides={"vocab_size": 50257},
                       corpus="bible", seq_len=32, batch_size=4, max_steps=6, warmup_steps=2,
                       eval_every=3, eval_batches=2, save_every=3)


def _rows(path) -> list[dict[str, str]]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(open(path))]


def test_resume_reproduces_the_uninterrupted_run(tmp_path) -> None:
    data = str(tmp_path / "tokens")
    full = _rows(train(_cfg(str(tmp_path / "a"), data), progress=False))
    assert len(full) == 6 and all(float(r["train_loss"]) > 0 for r in full)
    assert full[2]["val_loss"] and full[5]["val_loss"]
    cfg = _cfg(str(tmp_path / "b"), data)
    train(cfg, stop_after=4, progress=False)  # "killed" after step 4 (checkpoint at 3)
    resumed = _rows(train(cfg, progress=False))
    assert resumed == full
    assert os.path.exists(tmp_path / "b" / "model" / "config.json")
    assert os.path.getsize(tmp_path / "b" / "loss.png") > 1000


def test_config_change_is_refused(tmp_path) -> None:
    data = str(tmp_path / "tokens")
    cfg = _cfg(str(tmp_path / "a"), data)
    train(cfg, stop_after=3, progress=False)
    lr = cfg.lr
    cfg.lr = 1e-3
    with pytest.raises(ValueError, match=r"different config \(lr: 0\.0003 -> 0\.001\)"):
        train(cfg, progress=False)
    os.remove(tmp_path / "a" / "config.json")  # the checkpoint keeps the config too
    with pytest.raises(ValueError, match=r"different config \(lr: 0\.0003 -> 0\.001\)"):
        train(cfg, progress=False)
    # what cannot change the result may change: threads, when to save/evaluate, and a
    # longer run; a shorter one than the checkpoint is refused
    cfg.lr, cfg.threads, cfg.save_every, cfg.eval_every = lr, 1, 2, 2
    cfg.max_steps = 2
    with pytest.raises(ValueError, match="checkpoint is at step 3, beyond max_steps=2"):
        train(cfg, progress=False)
    cfg.max_steps = 8
    rows = _rows(train(cfg, progress=False))
    assert [int(r["step"]) for r in rows] == list(range(1, 9))


def test_torchrun_two_processes_match_one(tmp_path) -> None:
    """A real 2-process ``torchrun`` (gloo, CPU) equals one process on the same global
    batch, with gradient accumulation."""
    import subprocess
    import sys

    import yaml

    data = str(tmp_path / "tokens")
    base = _cfg(str(tmp_path / "single"), data)
    base.max_steps, base.grad_accum, base.threads = 4, 2, 1
    single = _rows(train(base, progress=False))
    cfg = {**{k: getattr(base, k) for k in base.__dataclass_fields__}, "out_dir":
           str(tmp_path / "ddp")}
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "structlm.cli", "train", str(path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = _rows(os.path.join(tmp_path, "ddp", "metrics.csv"))
    assert [r["step"] for r in ddp] == [r["step"] for r in single]
    for a, b in zip(ddp, single, strict=True):
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), rel=1e-5)
        if b["val_loss"]:
            assert float(a["val_loss"]) == pytest.approx(float(b["val_loss"]), rel=1e-5)
