"""Every folder structlm writes loads from any working directory after its source is
deleted (compressed, fine-tuned, converted, trained); a folder of the earlier compressed
format still loads where it was written, with a warning and a command that upgrades it;
a comparison against the source checks the source by content, not by name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm.cli import main  # noqa: E402
from tiny_models import tiny_llama  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bad_input_fixtures import TEXTS  # noqa: E402  (the sweep's four Austen openings)


def _cli(argv: list[str]) -> int:
    try:
        return int(main(argv) or 0)
    except SystemExit as e:
        return int(e.code or 0)


def _source(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """A tiny LLaMA with its own 300-token BPE tokenizer, and a text folder."""
    from structlm.data.bpe import train_bpe

    texts = root / "texts"
    texts.mkdir(parents=True)
    for name, text in TEXTS.items():
        (texts / name).write_text(text * 200)
    tok = train_bpe([t * 5 for t in TEXTS.values()], 300, root / "bpe")
    src = root / "src"
    tiny_llama(seed, vocab_size=300, max_position_embeddings=512).save_pretrained(src)
    tok.save_pretrained(src)
    return src, texts


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model.eval()(ids).logits


def _compress(tmp_path: Path, *extra: str) -> tuple[Path, Path]:
    src, texts = _source(tmp_path / "work")
    out = tmp_path / "work" / "out"
    assert _cli(["share", "compress", str(src), "--corpus", str(texts), "--second-corpus", "",
                 "--calib-tokens", "512", "--eval-tokens", "256", "--method", "svd-llm-w",
                 "--types", "mlp", "--target-reduction", "0.3", "--threads", "1",
                 "--out", str(out), *extra]) == 0
    return out / "model", src


@pytest.mark.parametrize("finetune", [False, True], ids=["compressed", "fine-tuned"])
def test_a_compressed_folder_loads_anywhere_after_its_source_is_deleted(
        tmp_path, monkeypatch, capsys, finetune) -> None:
    from transformers import AutoModelForCausalLM

    from structlm.hf.loading import load_model
    from structlm.share.compress.io import MANIFEST, WEIGHTS

    extra = ("--finetune-steps", "2", "--finetune-seq-len", "32",
             "--finetune-eval-tokens", "64") if finetune else ()
    folder, src = _compress(tmp_path, *extra)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["format"] == 2 and len(manifest["source_key"]) == 16
    before = _logits(load_model(str(folder)).model)
    shutil.rmtree(src)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = load_model(str(folder))
    assert loaded.tokenizer is not None and len(loaded.tokenizer) == 300
    torch.testing.assert_close(_logits(loaded.model), before, rtol=0, atol=0)
    plain = AutoModelForCausalLM.from_pretrained(str(folder))  # after import structlm
    torch.testing.assert_close(_logits(plain), before, rtol=0, atol=0)
    capsys.readouterr()
    assert _cli(["generate", "--model", str(folder), "--prompt", "Emma",
                 "--max-new-tokens", "3"]) == 0
    assert "Emma" in capsys.readouterr().out
    assert (folder / WEIGHTS).is_file() and not (folder / "model.safetensors").exists()


def test_plain_transformers_refuses_a_compressed_folder_instead_of_random_layers(
        tmp_path) -> None:
    folder, _ = _compress(tmp_path)
    code = ("import sys; from transformers import AutoModelForCausalLM\n"
            "try:\n    AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
            "except OSError as e:\n    print('refused', e)\nelse:\n    print('loaded')\n")
    run = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True,
                         text=True, timeout=300)
    assert run.stdout.startswith("refused"), run.stdout + run.stderr


def test_a_format_1_folder_warns_names_what_it_read_and_is_upgraded(
        tmp_path, monkeypatch, capsys) -> None:
    """The earlier layout (weights as model.safetensors, no config, source as typed):
    it loads from where it was written with a warning naming the folder it read, and
    ``structlm share self-contain`` makes it load anywhere."""
    from structlm.hf.loading import load_model
    from structlm.share.compress.io import MANIFEST, WEIGHTS

    folder, src = _compress(tmp_path)
    before = _logits(load_model(str(folder)).model)
    for name in os.listdir(folder):  # back to format 1
        if name not in (MANIFEST, WEIGHTS):
            os.remove(folder / name)
    os.replace(folder / WEIGHTS, folder / "model.safetensors")
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest.pop("format")
    manifest.pop("source_key")
    manifest["source_model"] = "src"  # as typed, relative to where it was written
    (folder / MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.chdir(src.parent)
    with pytest.warns(UserWarning, match=r"format 1.*share self-contain"):
        old = load_model(str(folder))
    torch.testing.assert_close(_logits(old.model), before, rtol=0, atol=0)
    capsys.readouterr()
    assert _cli(["share", "self-contain", str(folder)]) == 0
    assert "now self-contained" in capsys.readouterr().out
    assert _cli(["share", "self-contain", str(folder)]) == 0
    assert "already self-contained" in capsys.readouterr().out
    shutil.rmtree(src)
    monkeypatch.chdir(tmp_path)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no format-1 warning any more
        torch.testing.assert_close(_logits(load_model(str(folder)).model), before, rtol=0,
                                   atol=0)


def test_a_source_comparison_refuses_another_model_of_the_same_name(tmp_path,
                                                                  monkeypatch) -> None:
    from structlm.share.compress.io import MANIFEST, load_source

    folder, src = _compress(tmp_path)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["source_model"] = "src"
    (folder / MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.chdir(src.parent)
    assert load_source(folder).model_id == "src"  # the same content: accepted
    other = tmp_path / "other"
    other.mkdir()
    tiny_llama(7, vocab_size=300, max_position_embeddings=512).save_pretrained(other / "src")
    monkeypatch.chdir(other)
    with pytest.raises(ValueError, match=r"compressed from 'src' with content key .* not the "
                                         "same model"):
        load_source(folder)


def test_truncated_compressed_weights_are_named(tmp_path) -> None:
    from structlm.hf.loading import load_model
    from structlm.share.compress.io import WEIGHTS

    folder, _ = _compress(tmp_path)
    (folder / WEIGHTS).write_bytes((folder / WEIGHTS).read_bytes()[:200])
    with pytest.raises(ValueError, match=r"structlm_compressed.safetensors cannot be read .*"
                                         "damaged or truncated"):
        load_model(str(folder))


def test_a_converted_folder_loads_anywhere_after_its_source_is_deleted(
        tmp_path, monkeypatch) -> None:
    from structlm.convert import conversion_info, load_converted

    src, texts = _source(tmp_path / "work")
    out = tmp_path / "work" / "converted"
    assert _cli(["convert", str(src), "--algebra", "Q2^2", "--targets", "mlp",
                 "--corpus", str(texts), "--out", str(out)]) == 0
    before = _logits(load_converted(str(out)))
    shutil.rmtree(src)
    monkeypatch.chdir(tmp_path)
    back = load_converted(str(out))
    assert conversion_info(back)["algebra"] == "Q2^2"
    torch.testing.assert_close(_logits(back), before, rtol=0, atol=0)
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(str(out))) == 300


def test_a_trained_folder_loads_anywhere_with_its_tokenizer(tmp_path, monkeypatch) -> None:
    """A training run with the GPT-2 tokenizer: the folder holds it (plain
    ``AutoTokenizer`` loads it), and the model loads from another directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from structlm.train import TrainConfig, train

    texts = tmp_path / "texts"
    texts.mkdir()
    for name, text in TEXTS.items():
        (texts / name).write_text(text * 200)
    train(TrainConfig(out_dir=str(tmp_path / "run"), corpus=str(texts), preset="tiny",
                      algebra="Q2^2", model_overrides={"vocab_size": 50257}, seq_len=16,
                      batch_size=2, max_steps=2, warmup_steps=1, eval_every=2,
                      eval_batches=1, save_every=2, threads=1), progress=False)
    folder = tmp_path / "run" / "model"
    monkeypatch.chdir(tmp_path.parent)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert len(tok) <= model.get_input_embeddings().weight.shape[0]
    ids = tok("It is a truth", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_a_truncated_plain_model_folder_is_named(tmp_path) -> None:
    from structlm.hf.loading import load_model

    tiny_llama().save_pretrained(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:300])
    with pytest.raises(ValueError, match=r"cannot load model .*files cannot be read"):
        load_model(str(tmp_path / "m"))


def test_share_compress_checks_its_windows_against_the_context(tmp_path) -> None:
    from structlm.share.compress import CompressionConfig
    from structlm.share.compress.run import run_compress

    src, texts = _source(tmp_path)
    short = tmp_path / "short"
    tiny_llama(vocab_size=300, max_position_embeddings=256).save_pretrained(short)
    transformers.AutoTokenizer.from_pretrained(str(src)).save_pretrained(short)
    with pytest.raises(ValueError, match=r"seq_len=512 tokens are longer than the context "
                                         r"of model .* \(256 positions\)"):
        run_compress(str(short), CompressionConfig(), tmp_path / "o1", corpus=str(texts))
    from structlm.hf.finetune import FinetuneConfig

    with pytest.raises(ValueError, match=r"--finetune-seq-len\) 600: .* \(512 positions\)"):
        run_compress(str(src), CompressionConfig(), tmp_path / "o2", corpus=str(texts),
                     ft=FinetuneConfig(steps=1, seq_len=600))
    assert not any((tmp_path / o / "compress.json").exists() for o in ("o1", "o2"))
