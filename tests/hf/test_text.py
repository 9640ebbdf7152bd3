"""Token cache of ``tokenize_documents``: keyed by the tokenizer's definition, its EOS id
and the document's text; hits skip the tokenizer, an edit or another tokenizer misses."""

from __future__ import annotations

import pytest
import torch

from structlm.data.corpora import Document
from structlm.hf import text


def test_token_cache_hits_and_misses(tmp_path, monkeypatch) -> None:
    pytest.importorskip("transformers")
    from structlm.data.tokenizer import gpt2_tokenizer

    monkeypatch.setenv("STRUCTLM_CACHE", str(tmp_path))
    monkeypatch.setattr(text, "_TOKENS", {})
    tok = gpt2_tokenizer()
    docs = [Document("a/1", "It is a truth universally acknowledged."),
            Document("a/2", "That a single man in possession of a good fortune,")]
    first = text.tokenize_documents(tok, docs)
    assert first[0][-1] == tok.eos_token_id and len(list((tmp_path / "tokens").glob("*.pt"))) == 2
    calls = {"n": 0}
    real_call = type(tok).__call__

    def counting(self, *a, **k):
        calls["n"] += 1
        return real_call(self, *a, **k)

    monkeypatch.setattr(type(tok), "__call__", counting)
    monkeypatch.setattr(text, "_TOKENS", {})  # a new process: read from disk
    again = text.tokenize_documents(tok, docs)
    assert calls["n"] == 0 and all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    edited = [Document("a/1", docs[0].text + " Indeed."), docs[1]]
    out = text.tokenize_documents(tok, edited)
    assert calls["n"] == 1 and out[0].numel() > first[0].numel()  # the edit is tokenised
    assert torch.equal(out[1], first[1])
