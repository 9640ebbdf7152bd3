"""Nothing is lost: checkpoint swaps survive a kill at every step, one writer per run
folder, empty splits and changed corpora are caught before training."""

from __future__ import annotations

import csv
import fcntl
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import structlm.train.checkpoint as ck
from structlm.data.tokens import build_token_dataset
from structlm.train import TrainConfig, train


def _write(step: int):
    def write(folder: Path) -> None:
        (folder / "model.safetensors").write_text(f"model {step}")
        (folder / "state.pt").write_text(f"state {step}")
    return write


class _Killed(BaseException):
    pass


@pytest.mark.parametrize("kill_at", range(6))
def test_a_kill_at_any_point_of_the_swap_keeps_the_newest_complete_checkpoint(
        tmp_path, monkeypatch, kill_at: int) -> None:
    ckpt = tmp_path / "checkpoint"
    ck.write_checkpoint(ckpt, _write(3), 3)
    # the swap's file operations, in order: rmtree(tmp), [write], rmtree(old),
    # replace(ckpt, old), replace(tmp, ckpt), rmtree(old); kill before the kill_at-th
    calls = {"n": 0}
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def counted(real):
        def op(*args, **kwargs):
            if calls["n"] == kill_at:
                raise _Killed
            calls["n"] += 1
            return real(*args, **kwargs)
        return op

    monkeypatch.setattr(ck.os, "replace", counted(real_replace))
    monkeypatch.setattr(ck.shutil, "rmtree", counted(real_rmtree))
    try:
        ck.write_checkpoint(ckpt, _write(6), 6)
        finished = True
    except _Killed:
        finished = False
    monkeypatch.undo()
    found, notes = ck.recover_checkpoint(ckpt)
    assert found == ckpt
    step = ck.inspect_checkpoint(ckpt).step
    # the new checkpoint counts once its marker exists (written after the first op)
    assert step == (6 if finished or kill_at >= 1 else 3), (kill_at, notes)
    assert (ckpt / "model.safetensors").read_text() == f"model {step}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]  # nothing orphaned


def test_incomplete_temporaries_are_removed_and_never_chosen(tmp_path) -> None:
    ckpt = tmp_path / "checkpoint"
    ck.write_checkpoint(ckpt, _write(3), 3)
    half = tmp_path / "checkpoint.tmp-123"
    half.mkdir()
    (half / "model.safetensors").write_text("model 9")  # no state, no marker
    found, notes = ck.recover_checkpoint(ckpt)
    assert found == ckpt and ck.inspect_checkpoint(ckpt).step == 3
    assert not half.exists() and any(n.startswith("removed checkpoint.tmp-123") for n in notes)


@pytest.mark.parametrize("damage", ["garbage marker", "empty marker", "state missing",
                                    "model truncated", "model overwritten"])
def test_a_damaged_checkpoint_is_refused_never_deleted(tmp_path, damage: str) -> None:
    """A resume once deleted a checkpoint that looked incomplete and restarted from step 0
    silently: now it names the damaged file and the recovery, and deletes nothing."""
    ckpt = tmp_path / "checkpoint"
    ck.write_checkpoint(ckpt, _write(3), 3)
    shutil.copytree(ckpt, tmp_path / "keep3")
    ck.write_checkpoint(ckpt, _write(6), 6)
    os.replace(tmp_path / "keep3", tmp_path / "checkpoint.old")  # the previous complete copy
    if damage == "garbage marker":
        (ckpt / ck.COMPLETE).write_text("zz")
        named = "COMPLETE holds 'zz'"
    elif damage == "empty marker":
        (ckpt / ck.COMPLETE).write_text("")
        named = "COMPLETE holds ''"
    elif damage == "state missing":
        (ckpt / "state.pt").unlink()
        named = "state.pt is missing"
    elif damage == "model truncated":
        (ckpt / "model.safetensors").write_text("mo")
        named = "model.safetensors is 2 bytes"
    else:
        (ckpt / "model.safetensors").write_text("model 6 plus more")
        named = "model.safetensors is 17 bytes"
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(ck.RunError, match=named) as err:
        ck.recover_checkpoint(ckpt)
    assert "checkpoint.old (step 3) is kept" in str(err.value)
    assert "--restart" in str(err.value)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_discard_run_moves_aside(tmp_path) -> None:
    ck.write_checkpoint(tmp_path / "checkpoint", _write(3), 3)
    (tmp_path / "metrics.csv").write_text("step\n1\n")
    dest = ck.discard_run(tmp_path)
    assert dest is not None and sorted(p.name for p in dest.iterdir()) == [
        "checkpoint", "metrics.csv"]
    assert not (tmp_path / "checkpoint").exists()
    assert ck.discard_run(tmp_path) is None


def _cfg(tmp_path: Path, **kw) -> TrainConfig:
    return TrainConfig(**{**dict(out_dir=str(tmp_path / "run"), data_dir=str(tmp_path / "tok"),
                                 preset="tiny", algebra="Q2^2",
                                 model_overrides={"vocab_size": 50257}, corpus="bible",
                                 seq_len=16, batch_size=2, max_steps=6, warmup_steps=1,
                                 eval_every=3, eval_batches=1, save_every=3, threads=1), **kw})


def _rows(path: Path) -> list[dict[str, str]]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(open(path))]


def test_a_run_killed_between_the_renames_resumes_from_the_newer_checkpoint(tmp_path,
                                                                          capsys) -> None:
    full = _rows(train(_cfg(tmp_path, out_dir=str(tmp_path / "full")), progress=False))
    cfg = _cfg(tmp_path)
    train(cfg, stop_after=3, progress=False)
    run = Path(cfg.out_dir)
    shutil.copytree(run / "checkpoint", tmp_path / "step3")
    train(cfg, stop_after=6, progress=False)  # not finished: max_steps 6 reached below
    # the state a kill leaves after "checkpoint -> .old", before "tmp -> checkpoint"
    os.replace(run / "checkpoint", run / "checkpoint.tmp-999")
    shutil.copytree(tmp_path / "step3", run / "checkpoint.old")
    shutil.rmtree(run / "model", ignore_errors=True)
    assert _rows(train(cfg, progress=False)) == full
    assert "resumed from checkpoint.tmp-999 (step 6)" in capsys.readouterr().out
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint"]


def test_a_second_writer_of_a_run_folder_is_refused(tmp_path) -> None:
    cfg = _cfg(tmp_path)
    Path(cfg.out_dir).mkdir(parents=True)
    with open(Path(cfg.out_dir) / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        with pytest.raises(RuntimeError, match="being written by another process"):
            train(cfg, progress=False)
    assert not (Path(cfg.out_dir) / "metrics.csv").exists()


def test_a_one_document_corpus_is_refused_before_training(tmp_path) -> None:
    text = tmp_path / "one.txt"
    text.write_text("All the world's a stage, and all the men and women merely players. " * 50)
    cfg = _cfg(tmp_path, corpus=str(text))
    with pytest.raises(ValueError, match=r"the val split .* has 0 tokens in 0 documents"):
        train(cfg, progress=False)
    assert not (Path(cfg.out_dir) / "metrics.csv").exists()
    with pytest.raises(ValueError, match=r"val_fraction: 0\.0 is out of range: expected > 0 "
                                         "and < 1"):
        _cfg(tmp_path, val_fraction=0)


def test_the_token_cache_follows_the_corpus_content(tmp_path, capsys) -> None:
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("First document, long enough to matter. " * 20)
    (folder / "b.txt").write_text("Second document, also some words here. " * 20)
    first = build_token_dataset(str(folder), tmp_path / "cache", 0.5, 0)
    n = first.meta["train_tokens"] + first.meta["val_tokens"]
    assert build_token_dataset(str(folder), tmp_path / "cache", 0.5, 0).meta == first.meta
    (folder / "b.txt").write_text("Second document, edited: now a good deal longer. " * 40)
    edited = build_token_dataset(str(folder), tmp_path / "cache", 0.5, 0)
    assert edited.meta["train_tokens"] + edited.meta["val_tokens"] > n
    assert "content_sha1 changed" in capsys.readouterr().out
    (folder / "c.txt").write_text("A third document appears. " * 20)
    added = build_token_dataset(str(folder), tmp_path / "cache", 0.5, 0)
    assert len(added.meta["train_documents"]) + len(added.meta["val_documents"]) == 3


@pytest.mark.parametrize("victim", ["model.safetensors", "state.pt"])
def test_a_truncated_checkpoint_file_is_named(tmp_path, victim: str) -> None:
    cfg = _cfg(tmp_path, max_steps=6)
    train(cfg, stop_after=3, progress=False)
    path = Path(cfg.out_dir) / "checkpoint" / victim
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(RuntimeError, match=f"damaged: .*{victim} is 100 bytes"):
        train(cfg, progress=False)
    assert path.exists()  # named, not deleted


def test_restart_moves_a_damaged_run_aside_and_starts_over(tmp_path, capsys) -> None:
    cfg = _cfg(tmp_path, max_steps=3, save_every=3, eval_every=3)
    train(cfg, progress=False)
    run = Path(cfg.out_dir)
    (run / "checkpoint" / ck.COMPLETE).write_text("garbage")
    with pytest.raises(ck.RunError, match="COMPLETE holds 'garbage'"):
        train(cfg, progress=False)
    rows = _rows(train(cfg, progress=False, restart=True))
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    moved = [p for p in run.iterdir() if p.name.startswith("discarded-")]
    assert len(moved) == 1 and (moved[0] / "checkpoint" / ck.COMPLETE).read_text() == "garbage"
    assert "--restart: the run's checkpoints and metrics moved" in capsys.readouterr().out


def test_a_resume_on_changed_token_data_is_refused(tmp_path) -> None:
    """A corpus edited between runs once rebuilt the tokens (and a BPE tokenizer) and then
    resumed the checkpoint on them: now the resume is refused by name."""
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(4):
        (folder / f"d{i}.txt").write_text(f"Document {i} has these words in it. " * 60)
    cfg = _cfg(tmp_path, corpus=str(folder), max_steps=6, save_every=3)
    train(cfg, stop_after=3, progress=False)
    (folder / "d0.txt").write_text("An edited document with other words. " * 60)
    with pytest.raises(ck.RunError, match="content_sha1 changed"):
        train(cfg, progress=False)
    assert ck.inspect_checkpoint(Path(cfg.out_dir) / "checkpoint").step == 3


def test_a_diverging_run_names_the_step_and_the_last_finite_loss(tmp_path) -> None:
    cfg = _cfg(tmp_path, lr=1e6, max_steps=6)
    with pytest.raises(ck.RunError, match=r"non-finite .*step \d+; the last finite one was"):
        train(cfg, progress=False)


def test_a_moved_run_folder_resumes_where_it_stopped(tmp_path) -> None:
    """The run folder's place is not part of a run's identity (its data is checked by
    content): a run moved elsewhere resumes and ends as the unmoved one does."""
    full = _rows(train(_cfg(tmp_path, out_dir=str(tmp_path / "full")), progress=False))
    cfg = _cfg(tmp_path, data_dir="")
    train(cfg, stop_after=3, progress=False)
    shutil.move(cfg.out_dir, tmp_path / "moved")
    moved = _cfg(tmp_path, data_dir="", out_dir=str(tmp_path / "moved"))
    assert _rows(train(moved, progress=False)) == full
