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
* with ``bos_id`` the BOS token is put in front of every window (and the stream's first
  token is then scored too); windows ``(n, w)`` may instead already start with BOS (the
  tokenizer's prefix, :mod:`structlm.hf.bos`). Either way the record's ``bos`` says
  whether BOS was the first input of every scored window and ``bos_id`` which id — read
  from the ids actually scored, never from a flag;
* the negative log-likelihood is summed in float64; ``ppl = exp(sum / count)``; every
  window's own sum and token count are kept (``window_nll``, ``window_tokens``) with a
  fingerprint of the windows scored, so that two models scored on the same windows are
  compared paired by window (:mod:`structlm.stats`);
* any non-finite logit raises :class:`NonFiniteLogitsError` naming the window — a
  batch is never skipped silently;
* a batch whose logits and hidden states cannot fit in the memory available is refused
  before any work (a ``ValueError`` naming ``batch_size`` and the estimate), and an
  allocator failure while scoring becomes the same kind of message.

The log-probabilities of the next tokens come from :func:`next_token_logprobs`: for the
decoder families whose head is a plain linear map of the last hidden state (LLaMA,
Qwen2, Mistral) the head runs over chunks of positions, so a 151,936-token vocabulary
never materialises ``(batch, window, vocabulary)`` logits (1.2 GB at 4 × 512 for
Qwen2.5); any other model is called whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from tqdm import tqdm

from structlm.stats import WindowScores, windows_fingerprint

__all__ = ["NonFiniteLogitsError", "PerplexityResult", "available_memory", "batch_memory",
           "check_batch_memory", "chunked_head_logprobs", "leading_bos", "model_bos_ids",
           "next_token_logprobs", "perplexity", "plain_head", "scored_windows_key"]

PLAIN_HEAD_TYPES = ("llama", "qwen2", "mistral")
"""``config.model_type`` of the families whose causal-LM forward is exactly
``lm_head(model(ids).last_hidden_state)`` (no logit scaling or soft-capping)."""

HEAD_CHUNK_ELEMENTS = 1 << 25
"""Logits computed at once by the chunked head (128 MB in float32)."""


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or infinite logits."""


def plain_head(model: Any) -> tuple[Any, Any] | None:
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
    route = plain_head(model)
    tgt = ids[:, 1:]  # (b, L-1): position p predicts token p + 1
    if route is None:
        logits = model(input_ids=ids, use_cache=False).logits  # (b, L, V)
        if not torch.isfinite(logits).all():
            raise NonFiniteLogitsError(f"non-finite logits in {where or 'a batch'}")
        logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
        return logp.gather(-1, tgt[..., None]).squeeze(-1)
    body, head = route
    hidden = body(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]  # (b, L-1, d)
    return chunked_head_logprobs(head, hidden, tgt, where or "a batch", chunk_elements)


def chunked_head_logprobs(head: Any, hidden: torch.Tensor, targets: torch.Tensor,
                          where: str, chunk_elements: int = HEAD_CHUNK_ELEMENTS
                          ) -> torch.Tensor:
    """``(b, n)`` float32 log-probabilities of ``targets`` ``(b, n)`` under the linear
    ``head`` applied to ``hidden`` ``(b, n, d)``, over chunks of at most
    ``chunk_elements`` logits. Raises :class:`NonFiniteLogitsError` (naming ``where``)."""
    b, n, d = hidden.shape
    flat_h, flat_t = hidden.reshape(b * n, d), targets.reshape(b * n)
    rows = max(1, chunk_elements // head.out_features)
    out = torch.empty(b * n, dtype=torch.float32, device=hidden.device)
    for a in range(0, b * n, rows):
        logits = head(flat_h[a:a + rows]).float()  # (rows, V)
        if not torch.isfinite(logits).all():
            raise NonFiniteLogitsError(f"non-finite logits in {where}")
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
    """Whether BOS was the first input of every scored window (put in front, or already
    the windows' first id)."""
    window_nll: list[float] = field(default_factory=list)
    """Summed NLL of every window, in order (float64)."""
    window_tokens: list[int] = field(default_factory=list)
    """Scored tokens of every window."""
    windows_sha1: str = ""
    """:func:`structlm.stats.windows_fingerprint` of the scored windows (and BOS)."""
    bos_id: int | None = None
    """The BOS id every scored window started with (``None`` when ``bos`` is false)."""

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
               progress: bool = True, bos_token: int | None = None) -> PerplexityResult:
    """Perplexity of ``model`` on ``tokens`` ``(N,)`` under the module's protocol.

    ``tokens``: a ``(N,)`` stream, or ``(n, w)`` windows each scored on its own.
    ``bos_id``: prepend this token to every window (``None``: no BOS). ``bos_token``:
    the model's BOS id, to recognise windows ``(n, w)`` that already start with it
    (default: the BOS ids of the model's config and generation config).

    Raises:
        ValueError: bad shapes, window or stride; ``bos_id`` in front of windows that
            already start with it; a batch that does not fit in memory.
        NonFiniteLogitsError: a non-finite logit (the window is named).
    """
    if tokens.dim() == 2:
        return _perplexity_rows(model, tokens, bos_id, batch_size, progress, bos_token)
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
    for length, ws in groups.items():
        check_batch_memory(model, min(batch_size, len(ws)), length + extra, batch_size)
    bar = tqdm(total=len(wins), desc="perplexity", unit="window", disable=not progress)
    for _length, ws in groups.items():
        for i in range(0, len(ws), batch_size):
            chunk = ws[i:i + batch_size]
            ids = torch.stack([tokens[s:e] for s, _, e in chunk])  # (b, length)
            if bos_id is not None:
                ids = torch.cat([torch.full((len(chunk), 1), bos_id, dtype=ids.dtype), ids], 1)
            with _memory_errors(batch_size, ids.shape):
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
                            scored_windows_key(torch.cat([tokens.reshape(-1).cpu(),
                                                    layout.reshape(-1)]), bos_id), bos_id)


def model_bos_ids(model: Any) -> set[int]:
    """The BOS ids ``model``'s config, text config and generation config name."""
    out: set[int] = set()
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    for cfg in (config, text, getattr(model, "generation_config", None)):
        value = getattr(cfg, "bos_token_id", None)
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, int) and not isinstance(v, bool):
                out.add(v)
    return out


def leading_bos(model: Any, rows: torch.Tensor, bos_token: int | None) -> int | None:
    """The BOS id every row of ``rows`` already starts with, or ``None``."""
    first = int(rows[0, 0])
    known = {bos_token} if bos_token is not None else model_bos_ids(model)
    return first if first in known and bool((rows[:, 0] == first).all()) else None


@torch.no_grad()
def _perplexity_rows(model: Any, rows: torch.Tensor, bos_id: int | None, batch_size: int,
                     progress: bool, bos_token: int | None = None) -> PerplexityResult:
    """Each row of ``rows`` ``(n, w)`` is one window: tokens 1..w-1 scored (all w with a
    BOS in front)."""
    n, w = rows.shape
    if n < 1 or w < 2:
        raise ValueError(f"windows must be (n >= 1, w >= 2), got {tuple(rows.shape)}")
    leading = leading_bos(model, rows, bos_token)
    if bos_id is not None and leading == bos_id:
        raise ValueError(f"every window already starts with BOS {bos_id}: bos_id={bos_id} "
                         "would put a second one in front (leave bos_id out)")
    check_batch_memory(model, min(batch_size, n), w + (bos_id is not None), batch_size)
    device = next(model.parameters()).device
    nlls: list[float] = []
    toks: list[int] = []
    bar = tqdm(total=n, desc="perplexity", unit="window", disable=not progress)
    for i in range(0, n, batch_size):
        ids = rows[i:i + batch_size]  # (b, w)
        if bos_id is not None:
            ids = torch.cat([torch.full((ids.shape[0], 1), bos_id, dtype=ids.dtype), ids], 1)
        with _memory_errors(batch_size, ids.shape):
            logp = next_token_logprobs(model, ids.to(device),  # (b, w'-1)
                                       f"windows {i}..{i + len(ids) - 1}")
        nlls += (-logp.double().sum(1).cpu()).tolist()  # (b,): one sum per window
        toks += [logp.shape[1]] * logp.shape[0]
        bar.update(ids.shape[0])
    bar.close()
    count = sum(toks)
    nll = math.fsum(nlls) / count
    first = bos_id if bos_id is not None else leading
    return PerplexityResult(math.exp(nll), nll, count, n, w, w - 1, first is not None,
                            nlls, toks, scored_windows_key(rows.cpu(), bos_id), first)


def scored_windows_key(ids: torch.Tensor, bos_id: int | None) -> str:
    """The windows' content key (their ids and the BOS convention)."""
    return windows_fingerprint(torch.cat([ids.reshape(-1).long(),
                                          torch.tensor([-1 if bos_id is None else bos_id])]))


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device`` (``None``: unknown): the free
    memory of a CUDA device; on the CPU the least of ``MemAvailable`` and the cgroup's
    remaining limit."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    found: list[int] = []
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def batch_memory(model: Any, batch: int, length: int) -> int:
    """A lower bound on the bytes one forward of ``batch`` windows of ``length`` tokens
    holds at once: the logits over the vocabulary and their log-probabilities (or, where
    the head runs in chunks, one chunk) and two hidden states."""
    param = next(model.parameters())
    elem = param.element_size()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab = getattr(head, "out_features", None) or getattr(
        getattr(model, "config", None), "vocab_size", 0) or 0
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    hidden = getattr(emb, "embedding_dim", 0) or 0
    positions = batch * length
    if plain_head(model) is not None:
        logits = min(positions, max(1, HEAD_CHUNK_ELEMENTS // max(vocab, 1))) * vocab * 8
    else:
        logits = positions * vocab * elem + batch * (length - 1) * vocab * 4 * (
            1 if elem == 4 else 2)
    return int(logits + 2 * positions * hidden * elem)


def check_batch_memory(model: Any, batch: int, length: int, batch_size: int) -> None:
    """Refuse, before any work, a batch of ``batch`` windows of ``length`` tokens (from
    ``batch_size``) whose forward cannot fit in the memory available."""
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return
    avail = available_memory(device)
    need = batch_memory(model, batch, length)
    if avail is None or need <= avail:
        return
    fit = 0
    while fit < batch and batch_memory(model, fit + 1, length) <= avail:
        fit += 1
    advice = (f"use a batch size of at most {fit}" if fit else
              "even one window does not fit: use shorter windows")
    raise ValueError(f"batch_size (--batch-size) {batch_size}: scoring {batch} windows of "
                     f"{length} tokens at once needs at least {_size(need)} (logits and "
                     f"hidden states), more than the {_size(avail)} of memory available on "
                     f"{device}; {advice}")


def _size(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps a leading digit."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


@contextmanager
def _memory_errors(batch_size: int, shape: tuple[int, ...]) -> Iterator[None]:
    """An allocator failure while scoring a batch of ``shape`` as a clear ValueError."""
    try:
        yield
    except RuntimeError as err:
        text = str(err)
        if not (isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in text
                or "out of memory" in text.lower()):
            raise
        raise ValueError(f"batch_size (--batch-size) {batch_size}: ran out of memory "
                         f"scoring {shape[0]} windows of {shape[1]} tokens at once "
                         f"({text.splitlines()[0] if text else type(err).__name__}); use a "
                         "smaller batch size or shorter windows") from None
