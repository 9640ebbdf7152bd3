"""Perplexity, one protocol for every model (dense, compressed, any family).

Protocol (written into every result):

* the text is either a set of windows ``(n, w)`` drawn across documents
  (:func:`structlm.hf.text.sample_windows`; each row is scored on its own: every
  token after the row's first, ``n (w − 1)`` tokens in all — what every report uses),
  or one token stream (documents joined by EOS) of ``N`` tokens, cut as follows;
* it is scored in windows of at most ``window`` tokens; each window scores ``stride``
  new tokens (default ``window - 1``: non-overlapping windows, every token after the
  first scored exactly once, ``N - 1`` tokens in all); with ``stride < window - 1``
  each window re-reads ``window - stride`` tokens of context that are not scored again;
* with ``bos=True`` the tokenizer's BOS token is put in front of every window (and the
  stream's first token is then scored too);
* the negative log-likelihood is summed in float64; ``ppl = exp(sum / count)``;
* any non-finite logit raises :class:`NonFiniteLogitsError` naming the window — a
  batch is never skipped silently.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.nn import functional as F
from tqdm import tqdm

__all__ = ["NonFiniteLogitsError", "PerplexityResult", "perplexity"]


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or infinite logits."""


@dataclass
class PerplexityResult:
    """Perplexity and the protocol that produced it."""

    ppl: float
    nll: float
    tokens: int
    windows: int
    window: int
    stride: int
    bos: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _windows(n: int, window: int, stride: int, first: int) -> list[tuple[int, int, int]]:
    """(input start, first scored position, end) for each window over ``n`` tokens."""
    out = []
    a = first
    while a < n:
        b = min(a + stride, n)
        out.append((max(0, b - window), a, b))
        a = b
    return out


@torch.no_grad()
def perplexity(model: Any, tokens: torch.Tensor, window: int = 512, stride: int | None = None,
               bos_id: int | None = None, batch_size: int = 4,
               progress: bool = True) -> PerplexityResult:
    """Perplexity of ``model`` on ``tokens`` ``(N,)`` under the module's protocol.

    ``tokens``: a ``(N,)`` stream, or ``(n, w)`` windows each scored on its own.
    ``bos_id``: prepend this token to every window (``None``: no BOS)."""
    if tokens.dim() == 2:
        return _perplexity_rows(model, tokens, bos_id, batch_size, progress)
    if tokens.dim() != 1 or tokens.numel() < 2:
        raise ValueError(f"tokens must be a 1-D stream of >= 2 ids or (n, w) windows, got "
                         f"shape {tuple(tokens.shape)}")
    extra = 0 if bos_id is None else 1
    span = window - extra  # stream tokens per window
    if span < 2:
        raise ValueError(f"window {window} too small (need >= {2 + extra})")
    stride = span - 1 + extra if stride is None else stride
    if not 1 <= stride <= span:
        raise ValueError(f"stride must be in [1, {span}], got {stride}")
    n = tokens.numel()
    wins = _windows(n, span, stride, first=0 if bos_id is not None else 1)
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for w in wins:  # batch windows of equal length
        groups.setdefault(w[2] - w[0], []).append(w)
    bar = tqdm(total=len(wins), desc="perplexity", unit="window", disable=not progress)
    for _length, ws in groups.items():
        for i in range(0, len(ws), batch_size):
            chunk = ws[i:i + batch_size]
            ids = torch.stack([tokens[s:e] for s, _, e in chunk])  # (b, length)
            if bos_id is not None:
                ids = torch.cat([torch.full((len(chunk), 1), bos_id, dtype=ids.dtype), ids], 1)
            logits = model(input_ids=ids.to(device), use_cache=False).logits  # (b, L, V)
            if not torch.isfinite(logits).all():
                raise NonFiniteLogitsError(f"non-finite logits in the window(s) starting at "
                                           f"token {[s for s, _, _ in chunk]}")
            logp = F.log_softmax(logits.float(), dim=-1)
            for j, (s, a, e) in enumerate(chunk):
                # logits at input position p predict input token p + 1
                pos = torch.arange(a - s, e - s) + extra  # input positions of targets
                tgt = ids[j, pos].to(device)
                lp = logp[j, pos - 1].gather(-1, tgt[:, None]).squeeze(-1)
                total -= lp.double().sum().cpu()
                count += e - a
            bar.update(len(chunk))
    bar.close()
    nll = float(total) / count
    return PerplexityResult(math.exp(nll), nll, count, len(wins), window, stride,
                            bos_id is not None)


@torch.no_grad()
def _perplexity_rows(model: Any, rows: torch.Tensor, bos_id: int | None, batch_size: int,
                     progress: bool) -> PerplexityResult:
    """Each row of ``rows`` ``(n, w)`` is one window: tokens 1..w-1 scored (all w with a
    BOS in front)."""
    n, w = rows.shape
    if n < 1 or w < 2:
        raise ValueError(f"windows must be (n >= 1, w >= 2), got {tuple(rows.shape)}")
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    bar = tqdm(total=n, desc="perplexity", unit="window", disable=not progress)
    for i in range(0, n, batch_size):
        ids = rows[i:i + batch_size]  # (b, w)
        if bos_id is not None:
            ids = torch.cat([torch.full((ids.shape[0], 1), bos_id, dtype=ids.dtype), ids], 1)
        logits = model(input_ids=ids.to(device), use_cache=False).logits  # (b, w', V)
        if not torch.isfinite(logits).all():
            raise NonFiniteLogitsError(f"non-finite logits in windows {i}..{i + len(ids) - 1}")
        logp = F.log_softmax(logits[:, :-1].float(), dim=-1)  # position p predicts p + 1
        tgt = ids[:, 1:].to(device)
        total -= logp.gather(-1, tgt[..., None]).squeeze(-1).double().sum().cpu()
        count += tgt.numel()
        bar.update(ids.shape[0])
    bar.close()
    nll = float(total) / count
    return PerplexityResult(math.exp(nll), nll, count, n, w, w - 1, bos_id is not None)
