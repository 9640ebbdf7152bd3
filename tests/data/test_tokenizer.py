"""The offline GPT-2 BPE: tiktoken and the Hugging Face tokenizer built from it."""

from __future__ import annotations

import pytest

pytest.importorskip("tiktoken")
pytest.importorskip("transformers")

from structlm.data import gpt2_encoding, gpt2_tokenizer, load_tokenizer

TEXTS = ["Hello world", "The quick brown fox — naïve café, 12345 tokens!\n\n  indented",
         "  leading spaces, 'quotes' it's we'll\ttabs\r\nCRLF", "<|endoftext|>after"]


def test_known_ids() -> None:
    assert gpt2_encoding().encode("Hello world") == [15496, 995]
    assert gpt2_encoding().n_vocab == 50257


def test_hf_tokenizer_matches_tiktoken(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("STRUCTLM_CACHE", str(tmp_path))
    gpt2_tokenizer.cache_clear()
    tok = gpt2_tokenizer()
    assert (tmp_path / "gpt2-tokenizer" / "tokenizer.json").exists()
    assert len(tok) == 50257 and tok.eos_token_id == 50256 and tok.pad_token_id == 50256
    enc = gpt2_encoding()
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == enc.encode(text, allowed_special="all")
        assert tok.decode(ids) == text
    assert load_tokenizer("gpt2") is tok
    gpt2_tokenizer.cache_clear()
