"""FSDP2 under ``torchrun``: a real 2-process job on CPU (gloo) equals one process on the
same global batch, resumes from its own checkpoint, and writes checkpoints in the
single-process format (a single process resumes them)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from structlm.train import TrainConfig, load_config, train

JOB = """\
import os, shutil, sys
from structlm.train import load_config, train
cfg = load_config(sys.argv[1])
train(cfg, stop_after=4, progress=False)  # "killed" after step 4; checkpoint at step 3
if int(os.environ["RANK"]) == 0:
    shutil.copytree(os.path.join(cfg.out_dir, "checkpoint"), sys.argv[2])
train(cfg, progress=False)  # FSDP resumes from its own checkpoint
"""


def _cfg(out: str, data: str) -> TrainConfig:
    return TrainConfig(out_dir=out, data_dir=data, preset="tiny", algebra="Q2^2",
                       type_schedule="block:8", model_overrides={"vocab_size": 50257},
                       corpus="bible", seq_len=32, batch_size=4, max_steps=6, warmup_steps=2,
                       eval_every=3, eval_batches=2, save_every=3, grad_accum=2, threads=1)


def _rows(path: str | Path) -> list[dict[str, str]]:
    with open(path) as fh:
        return [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(fh)]


def _assert_same_curve(got: list[dict[str, str]], want: list[dict[str, str]]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        assert a["lr"] == b["lr"] and a["tokens"] == b["tokens"]
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), rel=1e-5)
        assert bool(a["val_loss"]) == bool(b["val_loss"])
        if b["val_loss"]:
            assert float(a["val_loss"]) == pytest.approx(float(b["val_loss"]), rel=1e-5)


def _assert_same_checkpoint(got: Path, want: Path) -> None:
    """Same format (names, tied-weight metadata, optimiser layout) and close values."""
    from safetensors import safe_open

    with safe_open(got / "model.safetensors", "pt") as g, \
            safe_open(want / "model.safetensors", "pt") as w:
        assert sorted(g.keys()) == sorted(w.keys()) and g.metadata() == w.metadata()
        for k in w.keys():
            torch.testing.assert_close(g.get_tensor(k), w.get_tensor(k), rtol=1e-4, atol=1e-6)
    a = torch.load(got / "state.pt", weights_only=False)
    b = torch.load(want / "state.pt", weights_only=False)
    assert a["step"] == b["step"] and a["scheduler"] == b["scheduler"]
    assert torch.equal(a["sampler"], b["sampler"]) and torch.equal(a["torch_rng"], b["torch_rng"])
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sorted(sa) == sorted(sb)
    for i in sb:
        assert sorted(sa[i]) == sorted(sb[i])
        for k in sb[i]:
            torch.testing.assert_close(sa[i][k], sb[i][k], rtol=1e-3, atol=1e-7)


def test_unknown_parallel_is_an_error(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"parallel: 'zero3' is not valid: expected one of "
                                         r"'auto', 'ddp', 'fsdp'"):
        TrainConfig(parallel="zero3")
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel: zero3\n")
    with pytest.raises(ValueError, match="zero3"):
        load_config(str(bad))


def test_fsdp_two_processes_match_one_and_resume(tmp_path) -> None:
    """``parallel: fsdp`` on 2 CPU processes: the curve of one process (with gradient
    accumulation, clipping on DTensor gradients, a kill and an FSDP resume), the same
    checkpoint format, and a single process continues an FSDP checkpoint."""
    import yaml

    data = str(tmp_path / "tokens")
    base = _cfg(str(tmp_path / "single"), data)
    single = _rows(train(base, progress=False))

    fsdp_dir, side = tmp_path / "fsdp", tmp_path / "fsdp-step3"
    cfg = {**{k: getattr(base, k) for k in base.__dataclass_fields__},
           "out_dir": str(fsdp_dir), "parallel": "fsdp"}
    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    job = tmp_path / "job.py"
    job.write_text(JOB)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(job), str(path), str(side)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_same_curve(_rows(fsdp_dir / "metrics.csv"), single)
    _assert_same_checkpoint(fsdp_dir / "checkpoint", tmp_path / "single" / "checkpoint")

    from structlm.models import StructLMForCausalLM

    exported = StructLMForCausalLM.from_pretrained(fsdp_dir / "model")
    assert type(exported) is StructLMForCausalLM
    assert exported.lm_head.weight.data_ptr() == exported.transformer.wte.weight.data_ptr()

    # the step-3 FSDP checkpoint in a single process, beside the FSDP run's config (the
    # engine is not part of a run's identity)
    resumed_dir = tmp_path / "from-fsdp"
    resumed_dir.mkdir()
    shutil.copytree(side, resumed_dir / "checkpoint")
    saved = json.loads((fsdp_dir / "config.json").read_text())
    assert saved["parallel"] == "fsdp"
    (resumed_dir / "config.json").write_text(json.dumps({**saved, "out_dir": str(resumed_dir)}))
    resumed = _rows(train(_cfg(str(resumed_dir), data), progress=False))
    _assert_same_curve(resumed, single[3:])
