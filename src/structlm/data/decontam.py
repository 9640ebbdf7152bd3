"""Near-duplicate decontamination (seed 000 App. I): 3-character shingles, MinHash/LSH
candidates (``datasketch``), then an exact Jaccard check of every candidate.

A training unit is removed when its exact shingle Jaccard similarity with any
held-out text is at least the threshold (0.80 by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from structlm.data.corpora import Document

__all__ = ["DecontamReport", "decontaminate", "jaccard", "shingles"]


def shingles(text: str, n: int = 3) -> set[str]:
    """Character ``n``-grams of the lower-cased, whitespace-collapsed text."""
    t = " ".join(text.lower().split())
    if len(t) < n:
        return {t} if t else set()
    return {t[i:i + n] for i in range(len(t) - n + 1)}


def jaccard(a: set[str], b: set[str]) -> float:
    """Exact Jaccard similarity of two shingle sets (1.0 for two empty sets)."""
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


@dataclass(frozen=True)
class DecontamReport:
    """What was removed: (training unit name, held-out index, exact Jaccard)."""

    removed: list[tuple[str, int, float]]
    candidates_checked: int
    kept: int


def _minhash(sh: set[str], num_perm: int, seed: int):
    from datasketch import MinHash

    m = MinHash(num_perm=num_perm, seed=seed)
    m.update_batch([s.encode() for s in sh])
    return m


def decontaminate(units: Sequence[Document], heldout: Sequence[str], threshold: float = 0.8,
                  num_perm: int = 128, seed: int = 1
                  ) -> tuple[list[Document], DecontamReport]:
    """Drop the ``units`` that are near-duplicates of any ``heldout`` text."""
    from datasketch import MinHashLSH

    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    held_sh = [shingles(t) for t in heldout]
    for i, sh in enumerate(held_sh):
        lsh.insert(str(i), _minhash(sh, num_perm, seed))
    kept, removed, checked = [], [], 0
    for doc in units:
        sh = shingles(doc.text)
        best: tuple[float, int] | None = None
        for key in lsh.query(_minhash(sh, num_perm, seed)):
            checked += 1
            j = jaccard(sh, held_sh[int(key)])
            if j >= threshold and (best is None or j > best[0]):
                best = (j, int(key))
        if best is None:
            kept.append(doc)
        else:
            removed.append((doc.name, best[1], best[0]))
    return kept, DecontamReport(removed, checked, len(kept))
