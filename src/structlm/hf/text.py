"""Token streams for calibration and evaluation, split by document.

A corpus (any spec :func:`structlm.data.corpora.load_corpus` accepts: ``austen``,
``shakespeare``, ``bible``, local files, ``+``-joined) is deduplicated and split into a
*calibration* part and a disjoint *evaluation* part by whole documents (a novel, a play,
a book). A second corpus of another domain can be evaluated too: its evaluation part is
used, so calibration never sees evaluation text.

Calibration and evaluation read **windows drawn across all documents** of their part
(:func:`sample_windows`, seeded), not the opening of the first one; fine-tuning reads
random windows of the whole calibration part. :func:`token_stream` (the first ``N``
tokens in document order) remains for prompts and the old protocol.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from structlm.data.corpora import Document, load_corpus
from structlm.data.tokens import dedup_exact, split_documents
from structlm.settings import cache_dir

__all__ = ["CorpusSplit", "WindowSample", "corpus_documents", "sample_windows", "split_corpus",
           "token_stream", "tokenize_documents", "window_prefix", "windows_for_scored_tokens"]


@dataclass
class CorpusSplit:
    """A corpus cut into calibration and evaluation documents."""

    corpus: str
    calibration: list[Document]
    evaluation: list[Document]

    def describe(self) -> dict[str, Any]:
        return {"corpus": self.corpus,
                "calibration_documents": [d.name for d in self.calibration],
                "evaluation_documents": [d.name for d in self.evaluation]}


def corpus_documents(corpus: str) -> list[Document]:
    """Every document of ``corpus``, exact duplicates removed (no split: one document is
    enough)."""
    docs, _ = dedup_exact(load_corpus(corpus))
    return docs


def split_corpus(corpus: str, eval_fraction: float = 0.25, seed: int = 0) -> CorpusSplit:
    """Documents of ``corpus``, exact duplicates removed, split by a seeded hash of their
    names (at least one document on each side)."""
    docs = corpus_documents(corpus)
    if len(docs) < 2:
        raise ValueError(f"corpus {corpus!r} has {len(docs)} document(s); need at least 2 "
                         "to keep calibration and evaluation text disjoint")
    calib, evaluation = split_documents(docs, eval_fraction, seed)
    return CorpusSplit(corpus, calib, evaluation)


def token_stream(tokenizer: Any, docs: list[Document], max_tokens: int) -> torch.Tensor:
    """The first ``max_tokens`` tokens of ``docs`` in order, each document followed by the
    tokenizer's EOS token (when it has one); ``(max_tokens,)`` int64.

    Raises when the documents hold fewer tokens than asked for."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for d in docs:
        text = d.text
        if len(text) > 8 * (max_tokens - len(ids)) + 1000:  # tokenise only what is needed
            text = text[: 8 * (max_tokens - len(ids)) + 1000]
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(int(eos))
        if len(ids) >= max_tokens:
            return torch.tensor(ids[:max_tokens], dtype=torch.long)
    raise ValueError(f"asked for {max_tokens} tokens but the {len(docs)} documents hold only "
                     f"{len(ids)}; lower the token count or use a larger corpus")


def _tokenizer_fingerprint(tokenizer: Any) -> str | None:
    """A hash of a fast tokenizer's full definition (vocabulary, merges, normalisation);
    ``None`` for tokenizers without one (their outputs are not cached)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    key = id(backend)
    cached = _FINGERPRINTS.get(key)
    if cached is None or cached[0] is not backend:
        cached = (backend, hashlib.sha1(backend.to_str().encode()).hexdigest())
        _FINGERPRINTS[key] = cached
    return cached[1]


_FINGERPRINTS: dict[int, tuple[Any, str]] = {}
_TOKENS: dict[str, torch.Tensor] = {}  # this process's documents, by content key


def _token_cache_dir() -> Path:
    return cache_dir("tokens")


def tokenize_documents(tokenizer: Any, docs: list[Document]) -> list[torch.Tensor]:
    """Every document's tokens in full, each followed by the tokenizer's EOS token (when it
    has one); one ``(n_i,)`` int64 tensor per document.

    Cached in memory and under ``$STRUCTLM_CACHE/tokens`` (default ``~/.cache/structlm``),
    keyed by a hash of the tokenizer's definition, its EOS id and the document's text, so
    an edited document or another tokenizer is tokenised afresh."""
    eos = getattr(tokenizer, "eos_token_id", None)
    fingerprint = _tokenizer_fingerprint(tokenizer)
    out = []
    for d in docs:
        key = None if fingerprint is None else hashlib.sha1(
            f"{fingerprint}|{eos}|".encode() + d.text.encode()).hexdigest()
        ids = _cached_tokens(key)
        if ids is None:
            toks = list(tokenizer(d.text, add_special_tokens=False)["input_ids"])
            if eos is not None:
                toks.append(int(eos))
            ids = torch.tensor(toks, dtype=torch.long)
            _store_tokens(key, ids)
        out.append(ids)
    return out


def _cached_tokens(key: str | None) -> torch.Tensor | None:
    if key is None:
        return None
    if key in _TOKENS:
        return _TOKENS[key]
    path = _token_cache_dir() / f"{key}.pt"
    if path.exists():
        try:
            ids = torch.load(path, weights_only=True).long()
        except Exception:
            return None
        _TOKENS[key] = ids
        return ids
    return None


def _store_tokens(key: str | None, ids: torch.Tensor) -> None:
    if key is None:
        return
    _TOKENS[key] = ids
    folder = _token_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix="tmp-", suffix=".part")
        os.close(fd)
        torch.save(ids.to(torch.int32), tmp)
        os.replace(tmp, folder / f"{key}.pt")
    except OSError:  # a read-only cache folder only costs the next run the tokenising
        pass


def window_prefix(tokenizer: Any) -> list[int]:
    """The ids the tokenizer's own convention puts before every input (e.g. Gemma's or
    LLaMA-2's BOS; none for SmolLM2 or GPT-2): what :func:`sample_windows` starts each
    window with, so a window cut from a document's tokens is what the model sees when it
    reads text."""
    if tokenizer is None:
        return []
    probe = "The"
    full = list(tokenizer(probe)["input_ids"])
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return [int(t) for t in full[:i]]
    return []


@dataclass
class WindowSample:
    """Windows drawn across documents: ``windows`` ``(n, window)`` and where they came
    from (document name → number of windows), for the report."""

    windows: torch.Tensor
    per_document: dict[str, int] = field(default_factory=dict)
    document_tokens: dict[str, int] = field(default_factory=dict)
    seed: int = 0
    prefix: list[int] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        n, w = self.windows.shape
        return {"windows": n, "window": w, "tokens": n * w, "seed": self.seed,
                "prefix": self.prefix,
                "prefix_convention": (f"every window starts with the tokenizer's prefix "
                                      f"{self.prefix} (what it adds to every input)"
                                      if self.prefix else "the tokenizer adds no prefix"),
                "sampling": "non-overlapping aligned windows drawn uniformly without "
                            "replacement from every document's window grid",
                "windows_per_document": self.per_document,
                "document_tokens": self.document_tokens}


def sample_windows(docs: list[Document], tokens: list[torch.Tensor], n_windows: int,
                   window: int, seed: int, prefix: list[int] | None = None) -> WindowSample:
    """``n_windows`` windows of ``window`` tokens drawn across all ``docs`` (seeded):
    each document is cut into non-overlapping aligned windows, the windows of all
    documents are pooled, and ``n_windows`` are drawn uniformly without replacement (so a
    document contributes in proportion to its length); the result is ordered by document
    and position. Raises when the documents hold fewer windows.

    ``prefix`` (:func:`window_prefix`): every window is these ids followed by
    ``window - len(prefix)`` document tokens."""
    prefix = list(prefix or [])
    body = window - len(prefix)
    if n_windows < 1 or body < 2:
        raise ValueError(f"need n_windows >= 1 and window >= 2 + {len(prefix)} prefix "
                         f"tokens, got {n_windows}, {window}")
    pool = [(di, s) for di, t in enumerate(tokens) for s in range(0, t.numel() - body + 1,
                                                                   body)]
    if len(pool) < n_windows:
        raise ValueError(f"asked for {n_windows} windows of {window} tokens but the "
                         f"{len(docs)} documents hold only {len(pool)}; lower the token "
                         f"count or use a larger corpus")
    gen = torch.Generator().manual_seed(seed)
    pick = sorted(pool[i] for i in torch.randperm(len(pool), generator=gen)[:n_windows].tolist())
    head = torch.tensor(prefix, dtype=torch.long)
    rows = torch.stack([torch.cat([head, tokens[di][s:s + body]]) for di, s in pick])
    per_doc: dict[str, int] = {}
    for di, _ in pick:
        per_doc[docs[di].name] = per_doc.get(docs[di].name, 0) + 1
    return WindowSample(rows, per_doc, {d.name: int(t.numel()) for d, t in
                                        zip(docs, tokens, strict=True)}, seed, prefix)


def windows_for_scored_tokens(n_tokens: int, window: int) -> int:
    """Windows of ``window`` tokens needed to score at least ``n_tokens`` tokens (each
    window scores all but its first token)."""
    return math.ceil(n_tokens / (window - 1))
