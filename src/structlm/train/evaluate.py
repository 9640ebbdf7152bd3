"""Loss on a whole token split, in float64 sums — pooled (:func:`split_loss`) or per window
(:func:`window_scores`, the per-window scores :mod:`structlm.stats` compares) — and the
unigram baseline it must beat."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from structlm.stats import WindowScores, windows_fingerprint

__all__ = ["pooled_window_scores", "split_loss", "split_windows", "unigram_loss",
           "window_scores"]

_PAD = -1
"""Fills the shorter last window in :func:`split_windows` (no token id is negative)."""


def split_windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """The windows :func:`split_loss` scores: consecutive, non-overlapping, ``seq_len``
    inputs plus the next token each, ``(n, seq_len + 1)`` int64, the shorter last one
    padded with ``-1`` (what :func:`~structlm.stats.windows_fingerprint` keys)."""
    n = len(tokens)
    if n < 2:
        raise ValueError(f"need at least 2 tokens to score, got {n}")
    starts = range(0, n - 1, seq_len)
    out = np.full((len(starts), seq_len + 1), _PAD, dtype=np.int64)
    for i, s in enumerate(starts):
        w = np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64)
        out[i, :len(w)] = w
    return out


@torch.no_grad()
def window_scores(model: Any, tokens: np.ndarray, seq_len: int, batch_size: int = 8,
                  progress: bool = True) -> WindowScores:
    """Summed next-token NLL (nats, float64) and scored tokens of every window of
    :func:`split_windows`: consecutive non-overlapping windows of ``seq_len`` inputs
    (positions ``0 .. seq_len - 1``, as in training), the last one shorter; every token
    but the first is scored exactly once. A non-finite window raises instead of being
    dropped. The fingerprint is :func:`~structlm.stats.windows_fingerprint` of the
    windows."""
    windows = split_windows(tokens, seq_len)
    device = next(model.parameters()).device
    lengths = (windows != _PAD).sum(1) - 1  # scored tokens per window
    nll = np.zeros(len(windows), dtype=np.float64)
    was_training = model.training
    model.eval()
    for i in tqdm(range(0, len(windows), batch_size), desc="evaluate", unit="batch",
                  disable=not progress):
        idx = np.arange(i, min(i + batch_size, len(windows)))
        for length in sorted(set(lengths[idx].tolist())):  # one length, one batch
            rows = idx[lengths[idx] == length]
            win = torch.from_numpy(windows[rows, :length + 1]).to(device)
            logits = model(win[:, :-1]).logits  # (b, length, V)
            per = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).double(), win[:, 1:].flatten(),
                reduction="none").view(len(rows), length).sum(1)  # (b,) float64
            if not torch.isfinite(per).all():
                bad = rows[~torch.isfinite(per).cpu().numpy()].tolist()
                raise FloatingPointError(f"non-finite loss in the windows {bad}")
            nll[rows] = per.cpu().numpy()
    model.train(was_training)
    return WindowScores(tuple(float(x) for x in nll), tuple(int(t) for t in lengths),
                        windows_fingerprint(windows))


def pooled_window_scores(model: Any, parts: dict[str, np.ndarray], seq_len: int,
                         batch_size: int = 8, progress: bool = True
                         ) -> tuple[dict[str, WindowScores], WindowScores]:
    """:func:`window_scores` of each part's tokens on their own (no window spans two
    parts) and the pooled scores: every part's windows in order, keyed on all of them."""
    per = {name: window_scores(model, t, seq_len, batch_size, progress)
           for name, t in parts.items()}
    pooled = WindowScores(tuple(x for s in per.values() for x in s.nll),
                          tuple(t for s in per.values() for t in s.tokens),
                          windows_fingerprint(np.concatenate(
                              [split_windows(t, seq_len) for t in parts.values()])))
    return per, pooled


def split_loss(model: Any, tokens: np.ndarray, seq_len: int, batch_size: int = 8,
               progress: bool = True) -> dict[str, float]:
    """Mean next-token cross-entropy over every token of ``tokens``: the windows of
    :func:`window_scores`, their float64 sums pooled. Returns ``loss``, ``tokens``
    scored, ``windows``."""
    s = window_scores(model, tokens, seq_len, batch_size, progress)
    return {"loss": s.mean_nll, "tokens": sum(s.tokens), "windows": len(s.nll)}


def unigram_loss(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of ``val_tokens`` under the training split's unigram
    frequencies (add-one smoothed), in float64: the loss a model that ignores context
    would reach; a trained LM should be well below it."""
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64),
                         minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts) - math.log(counts.sum())
    return float(-logp[np.asarray(val_tokens[1:], dtype=np.int64)].mean())
