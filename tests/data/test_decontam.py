"""Near-duplicate decontamination on real text (the King James Bible)."""

from __future__ import annotations

import pytest

pytest.importorskip("datasketch")

from structlm.data.corpora import Document, load_corpus
from structlm.data.decontam import decontaminate, jaccard, shingles


def test_shingles_and_jaccard() -> None:
    assert shingles("Ab  c") == {"ab ", "b c"}
    assert jaccard({"a"}, {"a"}) == 1.0 and jaccard({"a"}, {"b"}) == 0.0


def test_removes_near_duplicates_and_keeps_the_rest() -> None:
    verses = load_corpus("bible")[0].text.splitlines()  # Genesis, verse by verse
    heldout = verses[100:140]
    exact = [Document(f"exact/{i}", v) for i, v in enumerate(verses[100:105])]
    edited = [Document(f"edited/{i}", v.replace("and", "&", 1).upper())
              for i, v in enumerate(verses[110:115])]
    other = [Document(f"other/{i}", v) for i, v in enumerate(verses[300:340])]
    kept, report = decontaminate(exact + edited + other, heldout)
    gone = {name for name, _, _ in report.removed}
    assert {d.name for d in exact + edited} <= gone
    assert all(j >= 0.8 for _, _, j in report.removed)  # exact check of every candidate
    for d in other:  # unrelated verses stay unless they truly are near-duplicates
        sim = max(jaccard(shingles(d.text), shingles(h)) for h in heldout)
        assert (d.name in gone) == (sim >= 0.8)
    assert report.kept == len(kept) == len(exact + edited + other) - len(gone)
    with pytest.raises(ValueError, match="threshold"):
        decontaminate(other, heldout, threshold=0)


def test_token_dataset_is_decontaminated(tmp_path) -> None:
    from structlm.data.tokens import build_token_dataset

    docs = tmp_path / "docs"
    docs.mkdir()
    verses = load_corpus("bible")[1].text.splitlines()  # Exodus
    for i in range(12):
        (docs / f"d{i}.txt").write_text("\n".join(verses[i * 20:(i + 1) * 20]))
    held = tmp_path / "bench.jsonl"
    import json

    target = (docs / "d3.txt").read_text()
    held.write_text(json.dumps({"prompt": target[:len(target) // 2],
                                "response": target[len(target) // 2:]}) + "\n")
    ds = build_token_dataset(str(docs), tmp_path / "tok", val_fraction=0.0, heldout=str(held))
    gone = [name for name, _, _ in ds.meta["decontaminated"]]
    assert gone == ["file/d3.txt"] and "file/d3.txt" not in ds.meta["train_documents"]


def test_an_edited_heldout_file_is_read_again(tmp_path) -> None:
    """The token cache is keyed on the held-out texts' content, not their path: editing
    the held-out file rebuilds it (and decontaminates against the new text), and the
    dataset's fingerprint changes."""
    from structlm.data.tokens import build_token_dataset

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"d{i}.txt").write_text(f"document {i} " + " ".join(f"w{j}" for j in range(300)))
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("something else entirely, nothing like the corpus")
    first = build_token_dataset(str(corpus), tmp_path / "data", heldout=str(heldout))
    assert first.meta["decontaminated"] == []
    heldout.write_text((corpus / "d0.txt").read_text())  # now a copy of a training doc
    second = build_token_dataset(str(corpus), tmp_path / "data", heldout=str(heldout))
    assert second.fingerprint != first.fingerprint
    assert [name for name, *_ in second.meta["decontaminated"]] != []
