"""Tokenise a corpus once into memory-mapped token files, split by document.

``build_token_dataset(corpus, out_dir)`` writes ``train.bin`` / ``val.bin`` (uint16
token ids, each document followed by ``<|endoftext|>``; with ``test_split=True`` also
``test.bin``) and ``meta.json`` atomically,
and reuses them when the meta matches — including a SHA-1 of the corpus's document names
and texts, so a changed corpus is re-tokenised (and says so; a cache written before the
fingerprint existed is adopted once and fingerprinted). Exact duplicate documents (after
whitespace and case normalisation) are removed first; the validation split is a
deterministic set of whole documents — drawn per part for a ``+``-joined corpus, so every
part is validated on its own held-out documents (:meth:`TokenDataset.val_parts`).

The three-way split (``test_split=True``, :func:`split_documents_three_way`): each part's
held-out documents are dealt to validation (what decisions read) and test
(what verdicts read, :meth:`TokenDataset.test_parts`), so every part has both; the cache
key records the split, so a two-way cache is rebuilt, never reused.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from structlm.atomic import atomic_write_json
from structlm.config import RunError
from structlm.data.bpe import parse_tokenizer_spec
from structlm.data.corpora import Document, load_corpus
from structlm.data.tokenizer import gpt2_encoding

__all__ = ["THREE_WAY", "TokenDataset", "build_token_dataset", "corpus_fingerprint",
           "corpus_parts", "dedup_exact", "split_documents", "split_documents_three_way"]

_VERSION = 1

THREE_WAY = "train/validation/test"
"""``meta["splits"]`` of a build with a test split (absent from a two-way build's meta)."""


def dedup_exact(docs: list[Document]) -> tuple[list[Document], int]:
    """Drop exact duplicates (whitespace- and case-normalised); returns (kept, removed)."""
    seen: set[str] = set()
    kept = []
    for d in docs:
        key = hashlib.sha1(" ".join(d.text.lower().split()).encode()).hexdigest()
        if key not in seen:
            seen.add(key)
            kept.append(d)
    return kept, len(docs) - len(kept)


def corpus_fingerprint(docs: list[Document]) -> str:
    """SHA-1 over every document's name and text, in order: the token cache is keyed on
    the corpus's content, so an edited, added or removed file rebuilds it."""
    h = hashlib.sha1()
    for d in docs:
        for part in (d.name, d.text):
            b = part.encode()
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    return h.hexdigest()


def _hash_order(docs: list[Document], seed: int) -> list[Document]:
    """``docs`` in the seeded hash order of their names (the held-out draw's order)."""

    def score(d: Document) -> float:
        return int(hashlib.sha1(f"{seed}:{d.name}".encode()).hexdigest()[:12], 16) / 16**12

    return sorted(docs, key=score)


def split_documents(docs: list[Document], val_fraction: float, seed: int
                    ) -> tuple[list[Document], list[Document]]:
    """Whole documents to validation by a seeded hash of their names (at least one
    document on each side when there are two or more)."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    ranked = _hash_order(docs, seed)
    n_val = round(val_fraction * len(docs))
    if val_fraction > 0 and len(docs) >= 2:
        n_val = min(max(n_val, 1), len(docs) - 1)
    val = {d.name for d in ranked[:n_val]}
    return [d for d in docs if d.name not in val], [d for d in docs if d.name in val]


def split_documents_three_way(docs: list[Document], heldout_fraction: float, seed: int,
                              where: str = "the corpus"
                              ) -> tuple[list[Document], list[Document], list[Document]]:
    """``(train, validation, test)`` by whole documents: ``max(2, round(f·n))`` documents
    are held out (at most ``n − 1``: one trains), the first ones of the seeded hash order
    of :func:`split_documents` — so the held-out set contains the two-way split's
    validation documents — and dealt in that order, each to whichever of validation and
    test holds fewer characters so far (ties: validation). Documents of similar length
    alternate (validation, test, validation, …); a corpus of very unequal documents (the
    Bible's books: Obadiah to Deuteronomy) still gives test a share of its text, which a
    strict alternation would not. Both get at least one document. Austen's 6 novels at
    ``f = 0.1``: 4 / 1 / 1. Fewer than 3 documents cannot give all three a document: an
    error naming ``where``."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"the held-out fraction must be in (0, 1), got {heldout_fraction}")
    if len(docs) < 3:
        raise ValueError(f"{where} has {len(docs)} document(s): a train / validation / test "
                         "split by whole documents needs at least 3")
    ranked = _hash_order(docs, seed)
    n_held = min(max(2, round(heldout_fraction * len(docs))), len(docs) - 1)
    val: set[str] = set()
    test: set[str] = set()
    size = {"val": 0, "test": 0}
    for d in ranked[:n_held]:
        side = "val" if size["val"] <= size["test"] else "test"
        (val if side == "val" else test).add(d.name)
        size[side] += len(d.text)
    return ([d for d in docs if d.name not in val and d.name not in test],
            [d for d in docs if d.name in val], [d for d in docs if d.name in test])


def _encoder(tokenizer_dir: Path | None) -> tuple[Any, int]:
    """``(encode a list of texts, end-of-text id)`` for GPT-2 or a trained BPE folder."""
    if tokenizer_dir is None:
        enc = gpt2_encoding()
        return enc.encode_ordinary_batch, enc.eot_token
    from structlm.data.bpe import load_bpe

    tok = load_bpe(tokenizer_dir)

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.backend_tokenizer.encode_batch(texts,
                                                                  add_special_tokens=False)]

    return encode, int(tok.eos_token_id)


def _write_tokens(path: Path, docs: list[Document], tokenizer_dir: Path | None = None
                  ) -> list[int]:
    """Write ``docs`` (each followed by end-of-text) to ``path``; returns each document's
    token count, its end-of-text included."""
    encode, eot = _encoder(tokenizer_dir)
    ids = encode([d.text for d in docs]) if docs else []
    total = sum(len(x) + 1 for x in ids)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    arr = np.memmap(tmp, dtype=np.uint16, mode="w+", shape=(max(total, 1),))
    pos = 0
    for x in ids:
        arr[pos:pos + len(x)] = x
        arr[pos + len(x)] = eot
        pos += len(x) + 1
    arr.flush()
    del arr
    os.replace(tmp, path)
    return [len(x) + 1 for x in ids]


def corpus_parts(corpus: str) -> list[str]:
    """The ``+``-joined parts of a corpus spec, stripped (``"austen + bible"`` ->
    ``["austen", "bible"]``)."""
    return [p.strip() for p in corpus.split("+")]


def _split_by_part(docs: list[Document], part_of: dict[int, str], parts: list[str],
                   val_fraction: float, seed: int, test_split: bool = False
                   ) -> tuple[list[Document], list[tuple[str, list[Document]]],
                              list[tuple[str, list[Document]]]]:
    """Training documents and, per corpus part, its validation documents (and its test
    documents with ``test_split``; else none): every part is split on its own
    (:func:`split_documents`, :func:`split_documents_three_way`), so each part with two
    or more documents has at least one held out — a pooled draw could leave a small part
    (Austen's six novels) without any."""
    train: list[Document] = []
    val: list[tuple[str, list[Document]]] = []
    test: list[tuple[str, list[Document]]] = []
    for part in dict.fromkeys(parts):
        mine = [d for d in docs if part_of[id(d)] == part]
        if test_split:
            t, v, x = split_documents_three_way(mine, val_fraction, seed,
                                                where=f"corpus part {part!r}")
            test.append((part, x))
        else:
            t, v = split_documents(mine, val_fraction, seed)
        train += t
        val.append((part, v))
    return train, val, test


def _part_ranges(lengths: list[int], by_part: list[tuple[str, list[Document]]]
                 ) -> list[dict[str, Any]]:
    """Each part's token range in a split's file (its documents are consecutive there)."""
    ranges, start, first = [], 0, 0
    for part, v in by_part:
        end = start + sum(lengths[first:first + len(v)])
        ranges.append({"part": part, "documents": [d.name for d in v], "start": start,
                       "end": end})
        start, first = end, first + len(v)
    return ranges


def build_token_dataset(corpus: str, out_dir: str | os.PathLike[str], val_fraction: float = 0.1,
                        seed: int = 0, heldout: str = "", tokenizer: str = "gpt2",
                        rebuild: bool = True, why: str = "", test_split: bool = False
                        ) -> TokenDataset:
    """Tokenise ``corpus`` (see :func:`~structlm.data.corpora.load_corpus`) into
    ``out_dir``; reuse an existing build with the same corpus, split and tokenizer.

    ``heldout``: a corpus spec (e.g. a benchmark's ``.jsonl``) whose texts the training
    documents are decontaminated against (Jaccard >= 0.8 on 3-character shingles).
    ``tokenizer``: ``gpt2`` or ``bpe:<vocab>`` — a byte-level BPE trained on the training
    documents only (:mod:`.bpe`), saved in ``out_dir/tokenizer``.

    ``rebuild=False``: an existing build of other content is refused (a
    :class:`~structlm.config.RunError` naming what changed and ``why`` it must stay)
    instead of being rebuilt.

    ``test_split``: hold out test documents too — ``val_fraction`` of each part's
    documents (at least 2) held out and dealt to validation and test
    (:func:`split_documents_three_way`); written to ``test.bin``. The cache key records
    it (``meta["splits"]``)."""
    bpe_vocab = parse_tokenizer_spec(tokenizer)
    out = Path(out_dir)
    want = {"version": _VERSION, "corpus": corpus,
            "tokenizer": "gpt2-r50k" if bpe_vocab is None else f"bpe:{bpe_vocab}",
            "val_fraction": val_fraction, "seed": seed, "heldout": heldout}
    meta_path = out / "meta.json"
    parts = corpus_parts(corpus)
    if len(parts) > 1:
        want["split"] = "per-part"  # each part's documents are split on their own
    if test_split:
        want["splits"] = THREE_WAY  # absent from a two-way build: its key stays as it was
    loaded = [(part, load_corpus(part)) for part in parts] if len(parts) > 1 else [
        (corpus, load_corpus(corpus))]
    raw = [d for _, docs in loaded for d in docs]
    part_of = {id(d): part for part, docs in loaded for d in docs}
    want["content_sha1"] = corpus_fingerprint(raw)
    # keyed on the held-out texts' content too: an edited held-out file is re-read
    want["heldout_sha1"] = corpus_fingerprint(load_corpus(heldout)) if heldout else ""
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        adopt = [k for k in ("content_sha1", "heldout_sha1") if k not in meta]
        if adopt and not heldout and all(meta.get(k) == v for k, v in want.items()
                                         if k not in adopt):
            meta.update({k: want[k] for k in adopt})  # an older cache: adopt it once
            atomic_write_json(meta_path, meta)
        keys = {*want, "splits"}  # a three-way build never serves a two-way request
        if all(meta.get(k) == want.get(k) for k in keys):
            return TokenDataset(out)
        changed = sorted(k for k in keys if meta.get(k) != want.get(k))
        if not rebuild:
            raise RunError(f"the token data in {out} was built from other input "
                           f"({', '.join(changed)} changed){': ' + why if why else ''}; "
                           "restore the input, use another data_dir, or start over (structlm "
                           "train --restart)")
        print(f"rebuilding the token cache in {out}: {', '.join(changed)} changed", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    docs, removed = dedup_exact(raw)
    if len(parts) > 1:
        train, val_parts, test_parts = _split_by_part(docs, part_of, parts, val_fraction,
                                                      seed, test_split)
    elif test_split:
        train, val, test = split_documents_three_way(docs, val_fraction, seed,
                                                     where=f"corpus {corpus!r}")
        val_parts, test_parts = [(corpus, val)], [(corpus, test)]
    else:
        train, val = split_documents(docs, val_fraction, seed)
        val_parts, test_parts = [(corpus, val)], []
    val = [d for _, v in val_parts for d in v]
    test = [d for _, v in test_parts for d in v]
    contaminated: list[tuple[str, int, float]] = []
    if heldout:
        from structlm.data.decontam import decontaminate

        train, report = decontaminate(train, [d.text for d in load_corpus(heldout)])
        contaminated = report.removed
    tok_dir = None
    if bpe_vocab is not None:
        from structlm.data.bpe import train_bpe

        tok_dir = out / "tokenizer"
        train_bpe([d.text for d in train], bpe_vocab, tok_dir)
    meta = dict(want)
    val_lengths = _write_tokens(out / "val.bin", val, tok_dir)
    if test_split:
        test_lengths = _write_tokens(out / "test.bin", test, tok_dir)
        meta.update(test_documents=[d.name for d in test], test_tokens=sum(test_lengths),
                    test_parts=_part_ranges(test_lengths, test_parts))
    ranges = _part_ranges(val_lengths, val_parts)
    meta.update(
        duplicates_removed=removed, decontaminated=contaminated,
        train_documents=[d.name for d in train], val_documents=[d.name for d in val],
        train_tokens=sum(_write_tokens(out / "train.bin", train, tok_dir)),
        val_tokens=sum(val_lengths), val_parts=ranges,
        vocab_size=50257 if tok_dir is None else bpe_vocab,
        eot_token=_encoder(tok_dir)[1],
    )
    atomic_write_json(meta_path, meta)
    return TokenDataset(out)


@dataclass
class TokenDataset:
    """Memory-mapped train/val tokens of a built dataset folder."""

    root: Path

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.meta = json.loads((self.root / "meta.json").read_text())
        splits = ("train", "val", "test") if self.has_test else ("train", "val")
        self._maps = {s: np.memmap(self.root / f"{s}.bin", dtype=np.uint16, mode="r")[
            : self.meta[f"{s}_tokens"]] for s in splits}

    @property
    def has_test(self) -> bool:
        """Whether the build holds test documents (the three-way split)."""
        return self.meta.get("splits") == THREE_WAY

    @property
    def fingerprint(self) -> str:
        """What the tokens were built from — the corpus's and held-out texts' content,
        the split, the tokenizer (a trained BPE's files too) — as one digest: a run
        resumes only on the data it was trained on."""
        keys = ("version", "corpus", "tokenizer", "val_fraction", "seed", "content_sha1",
                "heldout_sha1")
        key = {k: self.meta.get(k) for k in keys}
        if "splits" in self.meta:  # a two-way build's digest stays what it always was
            key["splits"] = self.meta["splits"]
        h = hashlib.sha1(json.dumps(key, sort_keys=True).encode())
        tok = self.root / "tokenizer"
        if tok.is_dir():
            for f in sorted(tok.iterdir()):
                h.update(f.name.encode())
                h.update(f.read_bytes())
        return h.hexdigest()

    @property
    def vocab_size(self) -> int:
        """Vocabulary of the tokenizer the dataset was built with."""
        return int(self.meta.get("vocab_size", 50257))

    @property
    def eot_token(self) -> int:
        """The end-of-text id that separates documents."""
        return int(self.meta.get("eot_token", 50256))

    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer of the dataset (GPT-2 or its trained BPE)."""
        if (self.root / "tokenizer").exists():
            from structlm.data.bpe import load_bpe

            return load_bpe(self.root / "tokenizer")
        from structlm.data.tokenizer import gpt2_tokenizer

        return gpt2_tokenizer()

    def tokens(self, split: str) -> np.ndarray:
        """All tokens of ``split`` (``train``, ``val``, or ``test`` in a three-way build)."""
        if split not in self._maps:
            if split == "test":
                raise ValueError(f"{self.root} holds no test split (a train/validation "
                                 "build): build it with test_split=True")
            raise ValueError(f"unknown split {split!r}: expected one of {sorted(self._maps)}")
        return self._maps[split]

    def val_parts(self) -> dict[str, np.ndarray]:
        """The validation tokens of each corpus part (``shakespeare+austen`` ->
        ``{"shakespeare": ..., "austen": ...}``), in ``val.bin`` order; a one-part corpus
        (or a build that predates the per-part record) is one part, the whole split."""
        val = self.tokens("val")
        ranges = self.meta.get("val_parts") or [
            {"part": self.meta.get("corpus", "val"), "start": 0, "end": len(val)}]
        return {r["part"]: val[r["start"]:r["end"]] for r in ranges}

    def test_parts(self) -> dict[str, np.ndarray]:
        """The test tokens of each corpus part, in ``test.bin`` order (a one-part corpus is
        one part); an error for a build without a test split."""
        test = self.tokens("test")
        return {r["part"]: test[r["start"]:r["end"]] for r in self.meta["test_parts"]}

    def batch(self, split: str, batch_size: int, seq_len: int, gen: torch.Generator
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: inputs ``(B, T)`` and next-token targets ``(B, T)``."""
        data = self.tokens(split)
        if len(data) <= seq_len + 1:
            raise ValueError(f"split {split!r} has {len(data)} tokens, fewer than a window of "
                             f"{seq_len + 1}")
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        win = np.stack([data[s:s + seq_len + 1].astype(np.int64) for s in starts.tolist()])
        t = torch.from_numpy(win)
        return t[:, :-1], t[:, 1:]
