"""Per-window test scores (:func:`structlm.train.evaluate.window_scores`) and the
three-way split of the token data that a training run builds (``test_split``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from structlm.data.corpora import Document, load_corpus
from structlm.data.tokens import (
    THREE_WAY,
    build_token_dataset,
    split_documents,
    split_documents_three_way,
)
from structlm.stats import WindowScores, windows_fingerprint
from structlm.train.evaluate import (
    pooled_window_scores,
    split_loss,
    split_windows,
    window_scores,
)


def _model():
    from structlm.models import StructLMForCausalLM, config_from_preset

    torch.manual_seed(0)
    return StructLMForCausalLM(config_from_preset("study-tiny", "Q2^2",
                                                  type_schedule="block:2"))


def test_window_scores_are_per_window_float64_sums_of_every_token_once() -> None:
    model = _model()
    tokens = np.random.default_rng(1).integers(0, 512, 97).astype(np.uint16)
    got = window_scores(model, tokens, seq_len=10, batch_size=3, progress=False)
    assert isinstance(got, WindowScores)
    assert len(got.nll) == 10 and got.tokens == (10,) * 9 + (6,)  # 96 scored, last shorter
    for i, s in enumerate(range(0, 96, 10)):
        w = torch.from_numpy(tokens[s:s + 11].astype(np.int64))[None]
        with torch.no_grad():
            logits = model(w[:, :-1]).logits.double()
        want = float(torch.nn.functional.cross_entropy(logits[0], w[0, 1:], reduction="sum"))
        assert got.nll[i] == pytest.approx(want, rel=1e-6)
    assert all(x > 0 for x in got.nll)
    pooled = split_loss(model, tokens, seq_len=10, batch_size=3, progress=False)
    assert pooled["loss"] == pytest.approx(got.mean_nll, rel=1e-12)
    assert (pooled["tokens"], pooled["windows"]) == (96, 10)
    # the fingerprint keys the windows: the same tokens and seq_len, the same key
    wins = split_windows(tokens, 10)
    assert wins.shape == (10, 11) and (wins[-1, 7:] == -1).all()
    assert got.windows == windows_fingerprint(wins)
    assert window_scores(model, tokens, 11, 4, False).windows != got.windows
    other = tokens.copy()
    other[50] = (int(other[50]) + 1) % 512
    assert window_scores(model, other, 10, 3, False).windows != got.windows


def test_pooled_scores_keep_each_part_on_its_own() -> None:
    model = _model()
    rng = np.random.default_rng(2)
    parts = {"a": rng.integers(0, 512, 45).astype(np.uint16),
             "b": rng.integers(0, 512, 23).astype(np.uint16)}
    per, pooled = pooled_window_scores(model, parts, seq_len=10, batch_size=4, progress=False)
    assert pooled.nll == per["a"].nll + per["b"].nll
    assert pooled.tokens == per["a"].tokens + per["b"].tokens
    assert sum(pooled.tokens) == 44 + 22  # no window spans the two parts
    assert pooled.windows == windows_fingerprint(np.concatenate(
        [split_windows(parts["a"], 10), split_windows(parts["b"], 10)]))
    assert WindowScores.from_dict(pooled.as_dict()) == pooled


def _docs(prefix: str, lengths: list[int]) -> list[Document]:
    return [Document(f"{prefix}/{i}", "word " * n) for i, n in enumerate(lengths)]


def test_the_three_way_split_holds_out_at_least_two_documents_and_deals_them() -> None:
    six = _docs("austen", [900] * 6)
    train, val, test = split_documents_three_way(six, 0.1, 0)
    assert (len(train), len(val), len(test)) == (4, 1, 1)
    names = [{d.name for d in x} for x in (train, val, test)]
    assert not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])
    assert set().union(*names) == {d.name for d in six}
    # the held-out set contains the two-way split's validation documents
    _, two_way = split_documents(six, 0.1, 0)
    assert {d.name for d in two_way} <= names[1] | names[2]
    # unequal documents: each goes to the side with less text so far, so test gets text
    books = _docs("bible", [50, 3000, 40, 60, 45, 2500, 55] + [100] * 60)
    _, val, test = split_documents_three_way(books, 0.1, 0)
    assert len(val) + len(test) == 7
    size = [sum(len(d.text) for d in x) for x in (val, test)]
    assert min(size) > 0.3 * max(size)
    with pytest.raises(ValueError, match="'tiny' has 2 document"):
        split_documents_three_way(_docs("t", [10, 10]), 0.1, 0, where="'tiny'")


def test_the_study_corpora_each_give_validation_and_test_documents() -> None:
    """The CPU study's text (configs/study/cpu-verdicts.yaml): every corpus on its own."""
    from structlm.data.tokens import dedup_exact

    got = {}
    for corpus in ("shakespeare", "austen", "bible"):
        docs = dedup_exact(load_corpus(corpus))[0]
        got[corpus] = tuple(len(x) for x in split_documents_three_way(docs, 0.1, 0))
    assert got == {"shakespeare": (34, 2, 2), "austen": (4, 1, 1), "bible": (59, 5, 2)}


def _folder(root: Path, name: str, n: int) -> Path:
    folder = root / name
    folder.mkdir()
    for i in range(n):
        (folder / f"{name}{i}.txt").write_text(f"{name} {i}. " + " ".join(
            f"w{(i * 7 + j) % 13}" for j in range(150 + 31 * i)) + "\n")
    return folder


def test_a_test_split_build_is_disjoint_per_part_and_keyed_apart(tmp_path) -> None:
    big, small = _folder(tmp_path, "plays", 12), _folder(tmp_path, "novels", 3)
    corpus = f"{big} + {small}"
    two = build_token_dataset(corpus, tmp_path / "cache", 0.1, 0)
    assert not two.has_test and "splits" not in two.meta
    with pytest.raises(ValueError, match="holds no test split"):
        two.tokens("test")
    before = two.fingerprint
    data = build_token_dataset(corpus, tmp_path / "cache", 0.1, 0, test_split=True)
    assert data.meta["splits"] == THREE_WAY and data.has_test
    assert data.fingerprint != before  # a run trained on the two-way split will not resume
    tr, va, te = (set(data.meta[f"{s}_documents"]) for s in ("train", "val", "test"))
    assert not (tr & va or tr & te or va & te)
    for r_val, r_test in zip(data.meta["val_parts"], data.meta["test_parts"], strict=True):
        assert r_val["part"] == r_test["part"] and r_val["documents"] and r_test["documents"]
    parts = data.test_parts()
    assert list(parts) == [str(big), str(small)]
    assert sum(len(v) for v in parts.values()) == data.meta["test_tokens"]
    text = data.tokenizer().decode(np.asarray(parts[str(small)], dtype=np.int64).tolist())
    (doc,) = [d for d in load_corpus(str(small))
              if d.name in data.meta["test_parts"][1]["documents"]]
    assert text == doc.text + "<|endoftext|>"
    # a three-way cache never serves a two-way request (its training documents differ)
    again = build_token_dataset(corpus, tmp_path / "cache", 0.1, 0)
    assert "splits" not in again.meta and again.fingerprint == before
