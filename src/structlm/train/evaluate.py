"""Loss on a whole token split, in float64 sums, and the unigram baseline it must beat."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

__all__ = ["split_loss", "unigram_loss"]


@torch.no_grad()
def split_loss(model: Any, tokens: np.ndarray, seq_len: int, batch_size: int = 8,
               progress: bool = True) -> dict[str, float]:
    """Mean next-token cross-entropy over every token of ``tokens``: consecutive
    non-overlapping windows of ``seq_len`` inputs (positions ``0 .. seq_len - 1``, as in
    training), the last one shorter; each window's targets are the next tokens, so every
    token but the first is scored exactly once. Sums in float64; a non-finite window
    raises instead of being dropped. Returns ``loss``, ``tokens`` scored, ``windows``."""
    n = len(tokens)
    if n < 2:
        raise ValueError(f"need at least 2 tokens to score, got {n}")
    device = next(model.parameters()).device
    starts = list(range(0, n - 1, seq_len))
    total, scored = 0.0, 0
    was_training = model.training
    model.eval()
    for i in tqdm(range(0, len(starts), batch_size), desc="evaluate", unit="batch",
                  disable=not progress):
        group = starts[i:i + batch_size]
        lengths = [min(seq_len, n - 1 - s) for s in group]
        for length in sorted(set(lengths)):  # windows of one length form one batch
            rows = [s for s, m in zip(group, lengths, strict=True) if m == length]
            win = torch.from_numpy(np.stack([tokens[s:s + length + 1].astype(np.int64)
                                             for s in rows])).to(device)
            logits = model(win[:, :-1]).logits  # (b, length, V)
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(),
                                                    win[:, 1:].flatten(), reduction="sum")
            if not torch.isfinite(nll):
                raise FloatingPointError(f"non-finite loss in the windows starting at {rows}")
            total += float(nll)
            scored += win[:, 1:].numel()
    model.train(was_training)
    return {"loss": total / scored, "tokens": scored, "windows": len(starts)}


def unigram_loss(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of ``val_tokens`` under the training split's unigram
    frequencies (add-one smoothed), in float64: the loss a model that ignores context
    would reach; a trained LM should be well below it."""
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64),
                         minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts) - math.log(counts.sum())
    return float(-logp[np.asarray(val_tokens[1:], dtype=np.int64)].mean())
