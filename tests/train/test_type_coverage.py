"""Every position type is trained: schedules are checked against the training context."""

from __future__ import annotations

import csv
import glob
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from structlm.nn import AlgebraLinear
from structlm.nn.schedules import auto_schedule, get_schedule, type_counts
from structlm.train import TrainConfig, build_model, load_config, train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_schedule_that_leaves_types_untrained_is_refused() -> None:
    # the old cpu-small setting: 192-blocks in 256-token windows reach types 0 and 1 only
    with pytest.raises(ValueError, match=r"types \[2, 3\].*seq_len=256.*\[192, 64, 0, 0\]"):
        TrainConfig(algebra="Q2^2", type_schedule="block", seq_len=256)
    with pytest.raises(ValueError, match=r"'block'.*q=4.*types \[1, 2, 3\].*seq_len=128"):
        TrainConfig(algebra="Q4", type_schedule="block", seq_len=128)
    with pytest.raises(ValueError, match="shorter than q=4"):
        TrainConfig(algebra="Q2^2", seq_len=3)


def test_opt_in_allows_untrained_types() -> None:
    cfg = TrainConfig(algebra="Q2^2", type_schedule="block", seq_len=256,
                      allow_untrained_types=True)
    assert cfg.type_counts() == [192, 64, 0, 0]


@pytest.mark.parametrize(("q", "seq_len", "spec", "counts"), [
    (4, 128, "block:16", [32, 32, 32, 32]),
    (4, 1536, "block:192", [384] * 4),  # the paper's schedule at the paper's context
    (4, 7, "block:1", [2, 2, 2, 1]),
    (2, 97, "block:24", [49, 48]),
])
def test_auto_schedule_covers_every_type(q: int, seq_len: int, spec: str,
                                         counts: list[int]) -> None:
    assert auto_schedule(q, seq_len) == spec
    assert type_counts(get_schedule(spec, q), seq_len) == counts


def test_dense_has_one_type_and_no_check() -> None:
    cfg = TrainConfig(algebra="dense", type_schedule="block", seq_len=64)
    assert cfg.q == 1 and cfg.type_counts() == [64]


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_every_shipped_config_trains_every_type(path: str) -> None:
    cfg = load_config(path)
    counts = cfg.type_counts()
    assert len(counts) == cfg.q and min(counts) > 0, counts


def test_the_demo_trains_every_type(tmp_path) -> None:
    from structlm.experiments.demo import demo_train_config

    cfg = demo_train_config(tmp_path, steps=10, algebra="Q2^2")
    assert cfg.q == 4 and cfg.type_counts() == [32, 32, 32, 32]


def _block_grads(cfg: TrainConfig) -> list[torch.Tensor]:
    """Gradient norm of every weight block (beta, delta) of every FFN projection after one
    backward pass on a training window: ``(q, q)`` per projection."""
    model = build_model(cfg)
    ids = torch.randint(0, model.config.vocab_size, (2, cfg.seq_len))
    model(ids).logits.float().logsumexp(-1).mean().backward()
    out = []
    for mod in model.modules():
        if isinstance(mod, AlgebraLinear):
            ins, outs = list(mod.in_widths), list(mod.out_widths)
            g = mod.weight.grad
            norms = torch.zeros(mod.q, mod.q)
            for b in range(mod.q):
                for d in range(mod.q):
                    rows = slice(sum(outs[:d]), sum(outs[:d + 1]))
                    cols = slice(sum(ins[:b]), sum(ins[:b + 1]))
                    norms[b, d] = g[rows, cols].norm()
            used = torch.as_tensor(mod.support.used_blocks)
            out.append(norms[used])
    return out


@pytest.mark.parametrize("algebra", ["Q2^2", "Q4"])
def test_every_used_block_gets_a_gradient(algebra: str) -> None:
    base = dict(preset="tiny", algebra=algebra, seq_len=32)
    for norms in _block_grads(TrainConfig(**base)):  # auto: block:4
        assert (norms > 0).all()
    # the control: 192-blocks in a 32-token window leave blocks without gradient
    starved = _block_grads(TrainConfig(**base, type_schedule="block",
                                       allow_untrained_types=True))
    assert all((n == 0).any() for n in starved)


def test_training_records_tokens_per_type(tmp_path) -> None:
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), data_dir=str(tmp_path / "tok"),
                      preset="tiny", algebra="Q2^2", model_overrides={"vocab_size": 50257},
                      corpus="bible", seq_len=24, batch_size=2, max_steps=2, warmup_steps=1,
                      eval_every=2, eval_batches=1, save_every=2)
    rows = list(csv.DictReader(open(train(cfg, progress=False))))
    assert [r["type_tokens"] for r in rows] == ["12/12/12/12", "24/24/24/24"]
    info = json.loads((tmp_path / "run" / "types.json").read_text())
    assert info["model_schedule"] == "block:3"
    assert info["positions_per_type_per_window"] == [6, 6, 6, 6]
