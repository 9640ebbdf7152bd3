"""Commands that read a saved model folder use what the folder holds and refuse what does
not belong together: its own tokenizer (``generate``), the product its weights were saved
for, swapped or mismatched benchmark arms, a folder without tokenizer files."""

from __future__ import annotations

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm.cli import main  # noqa: E402
from tiny_models import tiny_llama, tiny_structlm  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3,
         "Emma Woodhouse, handsome, clever, and rich, with a comfortable home. " * 3,
         "It is a truth universally acknowledged that a single man must be in want. " * 3]


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = int(e.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _bpe_model(folder, algebra: str = "dense", seed: int = 0):
    """A tiny structlm model saved with its own 300-token BPE tokenizer."""
    from structlm.data.bpe import train_bpe

    tok = train_bpe(TEXTS, 300, folder / "tok")
    model = tiny_structlm(seed, algebra, vocab_size=300, eos_token_id=tok.eos_token_id,
                          bos_token_id=tok.bos_token_id)
    model.save_pretrained(folder / "model")
    tok.save_pretrained(folder / "model")
    return model, tok


def test_generate_tokenises_with_the_model_folders_own_tokenizer(tmp_path, capsys) -> None:
    """Greedy output equals the model run on its own BPE ids (GPT-2 ids would overflow the
    300-row embedding)."""
    model, tok = _bpe_model(tmp_path)
    prompt = "The quick brown"
    rc, out, err = _cli(["generate", "--model", str(tmp_path / "model"), "--prompt", prompt,
                         "--temperature", "0", "--max-new-tokens", "6"], capsys)
    assert rc == 0, err
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**ids, max_new_tokens=6, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    want = tok.decode(ref[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert out == f"### {prompt}\n{want}\n\n"


def test_a_config_naming_another_algebra_with_the_same_shapes_is_refused(tmp_path,
                                                                          capsys) -> None:
    """Q4 and Q2^2 share every weight shape: an edited config.json would load silently."""
    from transformers import AutoModelForCausalLM

    tiny_structlm(0, "Q4").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["algebra"] = "Q2^2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=re.escape("algebra: config.json says 'Q2^2', the "
                                                   "weights were saved for 'Q4'")):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    rc, _, err = _cli(["generate", "--model", str(tmp_path), "--prompt", "hi"], capsys)
    assert rc == 2 and "does not describe the saved weights" in err


def test_generate_refuses_non_finite_weights_and_a_folder_without_a_tokenizer(
        tmp_path, capsys) -> None:
    model = tiny_structlm(0, "Q2^2")
    with torch.no_grad():
        model.transformer.h[1].mlp.up.weight.view(-1)[3] = float("nan")
    model.save_pretrained(tmp_path / "nan")
    rc, _, err = _cli(["generate", "--model", str(tmp_path / "nan"), "--prompt", "hi"], capsys)
    assert rc == 2 and "non-finite weights" in err and "mlp.up.weight" in err
    tiny_llama().save_pretrained(tmp_path / "llama")  # no tokenizer files saved
    rc, _, err = _cli(["generate", "--model", str(tmp_path / "llama"), "--prompt", "hi"],
                      capsys)
    assert rc == 2 and "has no tokenizer files" in err


def test_bench_generate_refuses_swapped_folders_and_a_missing_tokenizer(tmp_path,
                                                                        capsys) -> None:
    for algebra in ("dense", "Q2^2"):
        tiny_structlm(1, algebra, vocab_size=50257).save_pretrained(tmp_path / algebra)
    base = ["bench", "generate", "--max-new-tokens", "2", "--runs", "2",
            "--out", str(tmp_path / "out" / "gen")]
    rc, _, err = _cli([*base, "--dense-model", str(tmp_path / "Q2^2"),
                       "--algebra-model", str(tmp_path / "dense")], capsys)
    assert rc == 2 and "are the two folders swapped?" in err
    assert not (tmp_path / "out").exists()  # refused before any timing
    rc, _, err = _cli([*base, "--dense-model", str(tmp_path / "dense"),
                       "--algebra-model", str(tmp_path / "Q2^2"),
                       "--tokenizer", str(tmp_path / "nonexistent")], capsys)
    assert rc == 2 and "no such folder" in err
    rc, _, err = _cli([*base, "--dense-model", str(tmp_path / "dense")], capsys)
    assert rc == 2 and "come together" in err


def test_bench_generate_uses_the_trained_models_own_tokenizer(tmp_path) -> None:
    from structlm.bench.generate import GenerateBenchConfig, _trained_pair

    _bpe_model(tmp_path / "d", "dense")
    _bpe_model(tmp_path / "a", "Q2^2")
    tok, models = _trained_pair(GenerateBenchConfig(
        dense_model=str(tmp_path / "d" / "model"), algebra_model=str(tmp_path / "a" / "model")))
    assert len(tok) == 300 and set(models) == {"dense", "algebra"}
    assert models["algebra"].config.algebra == "Q2^2"
