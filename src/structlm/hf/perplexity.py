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
* the negative log-likelihood is summed in float64; ``ppl = exp(sum / count)``; every
  window's own sum and token count are kept (``window_nll``, ``window_tokens``) with a
  fingerprint of the windows scored, so that two models scored on the same windows are
  compared paired by window (:mod:`structlm.stats`);
* any non-finite logit raises :class:`NonFiniteLogitsError` naming the window — a
  batch is never skipped silently.

The log-probabilities of the next tokens come from :func:`next_token_logprobs`: for the
decoder families whose head is a plain linear map of the last hidden state (LLaMA,
Qwen2, Mistral) the head runs over chunks of positions, so a 151,936-token vocabulary
never materialises ``(batch, window, vocabulary)`` logits (1.2 GB at 4 × 512 for
Qwen2.5); any other model is called whole.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.nn import functional as F
from tqdm import tqdm

from structlm.stats import WindowScores, windows_fingerprint

__all__ = ["NonFiniteLogitsError", "PerplexityResult", "next_token_logprobs", "perplexity"]

PLAIN_HEAD_TYPES = ("llama", "qwen2", "mistral")
"""``config.model_type`` of the families whose causal-LM forward is exactly
``lm_head(model(ids).last_hidden_state)`` (no logit scaling or soft-capping)."""

HEAD_CHUNK_ELEMENTS = 1 << 25
"""Logits computed at once by the chunked head (128 MB in float32)."""


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or infinite logits."""


def _plain_head(model: Any) -> tuple[Any, Any] | None:
    """``(body, head)`` when ``model``'s logits are ``head(body(ids).last_hidden_state)``."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_TYPES:
        return None
    if getattr(config, "final_logit_softcapping", None) or \
            getattr(config, "pretraining_tp", 1) != 1:
        return None
    head = model.get_output_embeddings()
    body = getattr(model, "model", None)
    if not isinstance(head, torch.nn.Linear) or body is None:
        return None
    return body, head


@torch.no_grad()
def next_token_logprobs(model: Any, ids: torch.Tensor, where: str = "",
                        chunk_elements: int = HEAD_CHUNK_ELEMENTS) -> torch.Tensor:
    """``(b, L - 1)`` float32 log-probabilities of ``ids[:, 1:]`` given their prefixes,
    for ``ids`` ``(b, L)`` on the model's device. Raises :class:`NonFiniteLogitsError`
    (mentioning ``where``) on any non-finite logit. The head runs over chunks of at
    most ``chunk_elements`` logits where the model allows it (module docstring)."""
    route = _plain_head(model)
    tgt = ids[:, 1:]  # (b, L-1): position p predicts token p + 1
    if route is None:
        logits = model(input_ids=ids, use_cache=False).logits  # (b, L, V)
        if not torch.isfinite(logits).all():
            raise NonFiniteLogitsError(f"non-finite logits in {where or 'a batch'}")
        logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
        return logp.gather(-1, tgt[..., None]).squeeze(-1)
    body, head = route
    hidden = body(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]  # (b, L-1, d)
    b, n, d = hidden.shape
    flat_h, flat_t = hidden.reshape(b * n, d), tgt.reshape(b * n)
    rows = max(1, chunk_elements // head.out_features)
    out = torch.empty(b * n, dtype=torch.float32, device=ids.device)
    for a in range(0, b * n, rows):
        logits = head(flat_h[a:a + rows]).float()  # (rows, V)
        if not torch.isfinite(logits).all():
            raise NonFiniteLogitsError(f"non-finite logits in {where or 'a batch'}")
        picked = logits.gather(-1, flat_t[a:a + rows, None]).squeeze(-1)
        out[a:a + rows] = picked - torch.logsumexp(logits, dim=-1)
    return out.view(b, n)


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
    window_nll: list[float] = field(default_factory=list)
    """Summed NLL of every window, in order (float64)."""
    window_tokens: list[int] = field(default_factory=list)
    """Scored tokens of every window."""
    windows_sha1: str = ""
    """:func:`structlm.stats.windows_fingerprint` of the scored windows (and BOS)."""

    def as_dict(self) -> dict[str, Any]:
        """Every field; the per-window scores in :class:`~structlm.stats.WindowScores`'
        compact form (``window_tokens`` stored once when all windows score alike)."""
        d = asdict(self)
        d.update(self.scores().as_dict())
        return d

    def scores(self) -> WindowScores:
        """The per-window scores, for :func:`structlm.stats.compare`."""
        return WindowScores(tuple(self.window_nll), tuple(self.window_tokens),
                            self.windows_sha1)


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
    per_window: dict[int, tuple[float, int]] = {}  # window start -> (NLL sum, tokens)
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
            logp = next_token_logprobs(  # (b, L-1): entry p scores input token p + 1
                model, ids.to(device),
                f"the window(s) starting at token {[s for s, _, _ in chunk]}")
            for j, (s, a, e) in enumerate(chunk):
                pos = torch.arange(a - s, e - s) + extra  # input positions of targets
                per_window[a] = (-float(logp[j, pos - 1].double().sum().cpu()), e - a)
            bar.update(len(chunk))
    bar.close()
    nlls = [per_window[a][0] for _, a, _ in wins]
    toks = [per_window[a][1] for _, a, _ in wins]
    count = sum(toks)
    nll = math.fsum(nlls) / count
    layout = torch.tensor([[s, a, e] for s, a, e in wins] + [[window, stride, extra]])
    return PerplexityResult(math.exp(nll), nll, count, len(wins), window, stride,
                            bos_id is not None, nlls, toks,
                            _fingerprint(torch.cat([tokens.reshape(-1).cpu(),
                                                    layout.reshape(-1)]), bos_id))


@torch.no_grad()
def _perplexity_rows(model: Any, rows: torch.Tensor, bos_id: int | None, batch_size: int,
                     progress: bool) -> PerplexityResult:
    """Each row of ``rows`` ``(n, w)`` is one window: tokens 1..w-1 scored (all w with a
    BOS in front)."""
    n, w = rows.shape
    if n < 1 or w < 2:
        raise ValueError(f"windows must be (n >= 1, w >= 2), got {tuple(rows.shape)}")
    device = next(model.parameters()).device
    nlls: list[float] = []
    toks: list[int] = []
    bar = tqdm(total=n, desc="perplexity", unit="window", disable=not progress)
    for i in range(0, n, batch_size):
        ids = rows[i:i + batch_size]  # (b, w)
        if bos_id is not None:
            ids = torch.cat([torch.full((ids.shape[0], 1), bos_id, dtype=ids.dtype), ids], 1)
        logp = next_token_logprobs(model, ids.to(device),  # (b, w'-1)
                                   f"windows {i}..{i + len(ids) - 1}")
        nlls += (-logp.double().sum(1).cpu()).tolist()  # (b,): one sum per window
        toks += [logp.shape[1]] * logp.shape[0]
        bar.update(ids.shape[0])
    bar.close()
    count = sum(toks)
    nll = math.fsum(nlls) / count
    return PerplexityResult(math.exp(nll), nll, count, n, w, w - 1, bos_id is not None,
                            nlls, toks, _fingerprint(rows.cpu(), bos_id))


def _fingerprint(ids: torch.Tensor, bos_id: int | None) -> str:
    """The windows' content key (their ids and the BOS convention)."""
    return windows_fingerprint(torch.cat([ids.reshape(-1).long(),
                                          torch.tensor([-1 if bos_id is None else bos_id])]))
