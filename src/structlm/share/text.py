"""Token streams for calibration and evaluation, split by document.

A corpus (any spec :func:`structlm.data.corpora.load_corpus` accepts: ``austen``,
``shakespeare``, ``bible``, local files, ``+``-joined) is deduplicated and split into a
*calibration* part and a disjoint *evaluation* part by whole documents (a novel, a play,
a book). A second corpus of another domain can be evaluated too: its evaluation part is
used, so calibration never sees evaluation text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..data.corpora import Document, load_corpus
from ..data.tokens import dedup_exact, split_documents

__all__ = ["CorpusSplit", "split_corpus", "token_stream"]


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


def split_corpus(corpus: str, eval_fraction: float = 0.25, seed: int = 0) -> CorpusSplit:
    """Documents of ``corpus``, exact duplicates removed, split by a seeded hash of their
    names (at least one document on each side)."""
    docs, _ = dedup_exact(load_corpus(corpus))
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
