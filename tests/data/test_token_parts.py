"""A ``+``-joined corpus is split part by part, and every part's held-out tokens are
addressable on their own (the per-domain validation of a study)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from structlm.data.corpora import load_corpus
from structlm.data.tokens import build_token_dataset, split_documents


def _folder(root: Path, name: str, n: int, words: str) -> Path:
    folder = root / name
    folder.mkdir()
    for i in range(n):
        (folder / f"{name}{i}.txt").write_text(f"{name} document {i}. " + " ".join(
            f"{words}{(i * 7 + j) % 13}" for j in range(200 + 37 * i)) + "\n")
    return folder


def test_each_part_holds_out_its_own_documents_and_its_tokens(tmp_path) -> None:
    big = _folder(tmp_path, "plays", 12, "thou")
    small = _folder(tmp_path, "novels", 3, "miss")
    corpus = f"{big} + {small}"
    data = build_token_dataset(corpus, tmp_path / "cache", 0.1, 0)
    assert data.meta["split"] == "per-part"
    parts = data.val_parts()
    assert list(parts) == [str(big), str(small)]
    by_part = {r["part"]: r for r in data.meta["val_parts"]}
    # a pooled draw of 10% of 15 documents could leave the 3-document part without any
    assert all(len(r["documents"]) >= 1 for r in by_part.values())
    for part, folder in ((str(big), big), (str(small), small)):
        docs = load_corpus(str(folder))
        _, val = split_documents(docs, 0.1, 0)
        assert by_part[part]["documents"] == [d.name for d in val]
        # the part's tokens decode to exactly its held-out documents, in order
        text = data.tokenizer().decode(np.asarray(parts[part], dtype=np.int64).tolist())
        assert text == "<|endoftext|>".join(d.text for d in val) + "<|endoftext|>"
    assert sum(len(v) for v in parts.values()) == data.meta["val_tokens"]
    assert not set(data.meta["val_documents"]) & set(data.meta["train_documents"])


def test_a_one_part_corpus_keeps_its_split_and_is_one_part(tmp_path) -> None:
    folder = _folder(tmp_path, "plays", 10, "thou")
    data = build_token_dataset(str(folder), tmp_path / "cache", 0.2, 0)
    assert "split" not in data.meta
    _, val = split_documents(load_corpus(str(folder)), 0.2, 0)
    assert data.meta["val_documents"] == [d.name for d in val]
    parts = data.val_parts()
    assert list(parts) == [str(folder)] and len(parts[str(folder)]) == data.meta["val_tokens"]
