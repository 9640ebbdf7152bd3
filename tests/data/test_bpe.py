"""The study's BPE: trained on the training documents only, exact size, lossless."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from structlm.data.bpe import load_bpe, parse_tokenizer_spec, train_bpe
from structlm.data.tokens import build_token_dataset


def test_spec_parsing_and_errors() -> None:
    assert parse_tokenizer_spec("gpt2") is None
    assert parse_tokenizer_spec("BPE:8192") == 8192
    with pytest.raises(ValueError, match=r"in \[260, 65535\]"):
        parse_tokenizer_spec("bpe:70000")
    with pytest.raises(ValueError, match="expected 'gpt2' or 'bpe:<vocab size>'"):
        parse_tokenizer_spec("sentencepiece")


def test_trained_bpe_is_lossless_with_eot_as_token_zero(tmp_path) -> None:
    texts = ["To be, or not to be: that is the question.\n" * 3,
             "Whether 'tis nobler in the mind to suffer — ünïcödé too.\n" * 2]
    tok = train_bpe(texts, 300, tmp_path / "tok")
    assert len(tok) == 300 and tok.eos_token_id == 0 and tok.convert_ids_to_tokens(0) == (
        "<|endoftext|>")
    for t in [*texts, "unseen words, ZEBRA 123"]:
        ids = tok(t)["input_ids"]
        assert max(ids) < 300 and tok.decode(ids) == t
    assert len(load_bpe(tmp_path / "tok")("To be")["input_ids"]) >= 1
    with pytest.raises(ValueError, match="fewer than the 5000 asked for"):
        train_bpe(["tiny"], 5000, tmp_path / "small")


def test_token_dataset_with_bpe_learns_from_training_documents_only(tmp_path) -> None:
    data = build_token_dataset("bible", tmp_path / "d", 0.1, 0, "", "bpe:512")
    assert data.vocab_size == 512 and data.eot_token == 0
    for split in ("train", "val"):
        toks = np.asarray(data.tokens(split))
        assert toks.max() < 512 and (toks == 0).sum() == len(data.meta[f"{split}_documents"])
    tok = data.tokenizer()
    # the merges come from the training books: the validation books' token count is what
    # the trained BPE gives them, and decoding gives their text back
    from structlm.data.corpora import load_corpus

    val_doc = next(d for d in load_corpus("bible") if d.name == data.meta["val_documents"][0])
    ids = tok(val_doc.text)["input_ids"]
    assert tok.decode(ids) == val_doc.text
    assert list(np.asarray(data.tokens("val"))[:len(ids)]) == ids
    # the same BPE trained on the training documents alone: identical vocabulary
    from structlm.data.tokens import dedup_exact, split_documents

    train_docs, _ = split_documents(dedup_exact(load_corpus("bible"))[0], 0.1, 0)
    alone = train_bpe([d.text for d in train_docs], 512, tmp_path / "alone")
    assert alone.get_vocab() == tok.get_vocab()
    # a second build with the same settings is reused, another tokenizer rebuilds
    assert build_token_dataset("bible", tmp_path / "d", 0.1, 0, "", "bpe:512").meta == data.meta
    assert build_token_dataset("bible", tmp_path / "d", 0.1, 0, "", "gpt2").vocab_size == 50257
