"""Corpora on real data: Jane Austen from Debian's ``r-cran-janeaustenr`` and Hugging Face
``datasets`` (built locally, no network). The Austen package is downloaded once into the
default ``$STRUCTLM_CACHE``; later runs read the cached JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from structlm.data.builtin_corpora import AUSTEN_TITLES, _ar_members, _cache
from structlm.data.corpora import BUILTIN_CORPORA, Document, load_corpus


@pytest.fixture(scope="module")
def austen() -> dict[str, str]:
    return {d.name: d.text for d in load_corpus("austen")}


def test_austen_has_the_six_novels(austen: dict[str, str]) -> None:
    assert list(austen) == [f"austen/{t}" for t in (
        "Sense & Sensibility", "Pride & Prejudice", "Mansfield Park", "Emma",
        "Northanger Abbey", "Persuasion")]
    assert list(AUSTEN_TITLES.values()) == [n.removeprefix("austen/") for n in austen]
    pride = austen["austen/Pride & Prejudice"]
    assert pride.startswith("PRIDE AND PREJUDICE\n\nBy Jane Austen")
    assert "It is a truth universally acknowledged, that a single man in possession" in pride
    assert "Mr. Darcy" in pride and "Elizabeth" in pride
    assert "Emma Woodhouse, handsome, clever, and rich" in austen["austen/Emma"]
    assert "Sir Walter Elliot, of Kellynch Hall" in austen["austen/Persuasion"]
    assert "Catherine Morland" in austen["austen/Northanger Abbey"]
    assert "Fanny Price" in austen["austen/Mansfield Park"]
    assert "Dashwood" in austen["austen/Sense & Sensibility"]
    sizes = {n: len(t) for n, t in austen.items()}
    assert all(400_000 < s < 1_000_000 for s in sizes.values()), sizes
    assert 3_800_000 < sum(sizes.values()) < 4_300_000  # measured: 4,025,028 characters
    assert all(t.endswith("\n") and "\r" not in t for t in austen.values())


def test_austen_is_cached_and_joins_with_other_corpora(austen: dict[str, str]) -> None:
    cached = _cache() / "r-cran-janeaustenr" / "austen-v1.json"
    assert json.loads(cached.read_text(encoding="utf-8")) == {
        n.removeprefix("austen/"): t for n, t in austen.items()}
    deb = next(cached.parent.glob("r-cran-janeaustenr_*.deb"))
    names = [name for name, _ in _ar_members(deb.read_bytes())]  # the stdlib .deb reader
    assert names[0] == "debian-binary" and any(n.startswith("data.tar") for n in names)
    docs = load_corpus("austen + austen")
    assert len(docs) == 12 and docs[6:] == docs[:6]


def test_unknown_corpus_lists_the_builtins(tmp_path: Path) -> None:
    assert {"austen", "bible", "shakespeare"} <= set(BUILTIN_CORPORA)
    with pytest.raises(ValueError, match=r"unknown corpus 'nope'.*'austen'.*hf:"):
        load_corpus("nope")
    with pytest.raises(ValueError, match="unknown corpus"):
        load_corpus(f"austen+{tmp_path / 'missing.txt'}")


def test_hf_dataset_saved_to_disk(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["first row", "second row"], "n": [1, 2]}) \
        .save_to_disk(str(tmp_path / "plain"))
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"prompt": ["Q1?"], "response": ["A1."]}),
        "test": datasets.Dataset.from_dict({"prompt": ["Q2?"], "response": ["A2."]}),
    }).save_to_disk(str(tmp_path / "dict"))
    plain, dd = tmp_path / "plain", tmp_path / "dict"
    assert load_corpus(f"hf:{plain}") == [Document(f"hf/{plain}/0", "first row"),
                                          Document(f"hf/{plain}/1", "second row")]
    assert load_corpus(f"hf:{dd}") == [Document(f"hf/{dd}/0", "Q1?\nA1.")]
    assert load_corpus(f"hf:{dd}:test") == [Document(f"hf/{dd}/0", "Q2?\nA2.")]
    assert load_corpus(f"hf:{dd}:test:response") == [Document(f"hf/{dd}/0", "A2.")]
    assert len(load_corpus(f"hf:{plain} + hf:{dd}:test")) == 3
    with pytest.raises(ValueError, match=r"no split 'valid'.*\['test', 'train'\]"):
        load_corpus(f"hf:{dd}:valid")
    with pytest.raises(ValueError, match="single Dataset without splits"):
        load_corpus(f"hf:{plain}:test")
    with pytest.raises(ValueError, match=r"no column 'body'; columns are \['text', 'n'\]"):
        load_corpus(f"hf:{plain}::body")
    with pytest.raises(ValueError, match="bad Hugging Face corpus"):
        load_corpus("hf:a:b:c:d")


def test_hf_json_builder_on_a_local_file(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({"body": f"row {i}", "id": i}) for i in range(5)))
    docs = load_corpus(f"hf:json:{data}::body")
    assert [d.text for d in docs] == [f"row {i}" for i in range(5)]
    assert docs[0].name == f"hf/json:{data}/0"
    assert [d.text for d in load_corpus(f"hf:json:{data}:train[1:3]:body")] == ["row 1", "row 2"]
    with pytest.raises(ValueError, match=r"expected 'prompt'/'response' or 'text' fields"):
        load_corpus(f"hf:json:{data}")
    with pytest.raises(ValueError, match="bad Hugging Face corpus"):
        load_corpus("hf:json:")


def test_django_is_the_pinned_package_source_one_document_per_file() -> None:
    docs = {d.name: d.text for d in load_corpus("django")}
    assert len(docs) == 732  # measured: every non-empty .py file of django/ in 5.1.4
    assert all(n.startswith("django/") and not n.endswith(".py") for n in docs)
    assert "class QuerySet(AltersData):" in docs["django/db/models/query"]
    assert 'VERSION = (5, 1, 4, "final", 0)' in docs["django/__init__"]
    assert not any("/tests/" in n for n in docs)  # the project's test suite is outside
    assert 5_400_000 < sum(len(t) for t in docs.values()) < 5_700_000  # measured: 5,542,708
