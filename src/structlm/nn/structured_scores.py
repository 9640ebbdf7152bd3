"""Structured attention scores (seed 000 appendix G, SPEC §A.5).

Each head's dimension ``hs`` is split into ``q`` groups of width ``m = hs / q``. A query
of type ``i`` and a key of type ``j`` use only the groups ``F(i, j)``:

    r_pu = sum_{a in F(i, j)} <Q_p^(a), K_u^(a)>,    s_pu = r_pu / sqrt(|F(i, j)| m),

then the usual masked softmax and a dense ``P V``. ``F`` comes from the FFN algebra's
layer support ``S[alpha, beta, delta]`` as ``F(i, j) = {a : S[i, a, j]}``: for ``Q_q``
that is ``{i, j}`` (one group when ``i = j``), the seed's definition; for tensor powers
the bitwise rule ``a_k in {i_k, j_k}`` (``|F| = 2^hamming(i, j)``), whose mean
``|F| / q`` over balanced types is ``(3/4)^L`` — the seed's ``Q_2^{⊗2}`` bound
``2 / (1 + 9/16) = 1.280×``.

Two implementations: :func:`structured_scores_reference` (every group's dot product for
every pair, then masked: the definition) and :func:`structured_attention`, which sorts
queries and keys by type and multiplies each (query type, key type) block on its
``|F(i, j)| m`` columns only, so its score MACs are :func:`structured_score_macs` —
``rho_score`` of the dense ``T S hs``. Full keys and values stay in the cache (a later
query may read any group of a key).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

__all__ = ["score_groups", "structured_attention", "structured_rho", "structured_score_macs",
           "structured_scores_reference"]


def score_groups(support_mask: np.ndarray) -> torch.Tensor:
    """``(q, q, q)`` bool ``G[i, j, a]``: group ``a`` scores a type-``i`` query against a
    type-``j`` key, ``G[i, j, a] = S[i, a, j]``. Every pair uses at least its own groups
    (``a = i`` and ``a = j``)."""
    mask = np.asarray(support_mask, dtype=bool)
    if mask.ndim != 3 or len(set(mask.shape)) != 1:
        raise ValueError(f"support mask must be (q, q, q), got {mask.shape}")
    groups = mask.transpose(0, 2, 1)  # [i, j, a] = S[i, a, j]
    idx = np.arange(groups.shape[0])
    if not (groups[idx[:, None], idx[None, :], idx[:, None]].all()
            and groups[idx[:, None], idx[None, :], idx[None, :]].all()):
        raise ValueError("the support does not give every query-key pair its own groups "
                         "(S[i, i, j] and S[i, j, j]): not a structured-score algebra")
    # numpy first: models are built under transformers' meta-device context
    return torch.tensor(groups.tolist(), dtype=torch.bool, device="cpu")


def _check(q: torch.Tensor, k: torch.Tensor, qtypes: torch.Tensor, ktypes: torch.Tensor,
           groups: torch.Tensor) -> int:
    nq = groups.shape[0]
    hs = q.shape[-1]
    if hs % nq:
        raise ValueError(f"head size {hs} is not divisible by q={nq}: structured scores "
                         "split each head into q equal groups")
    if q.shape[:2] != k.shape[:2] or k.shape[-1] != hs:
        raise ValueError(f"query {tuple(q.shape)} and key {tuple(k.shape)} do not match")
    if qtypes.shape != (q.shape[0], q.shape[2]) or ktypes.shape != (k.shape[0], k.shape[2]):
        raise ValueError(f"types {tuple(qtypes.shape)}, {tuple(ktypes.shape)} do not match "
                         f"(B, T) = {(q.shape[0], q.shape[2])} and (B, S) = "
                         f"{(k.shape[0], k.shape[2])}")
    return hs // nq


def structured_scores_reference(q: torch.Tensor, k: torch.Tensor, qtypes: torch.Tensor,
                                ktypes: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """The definition: scaled scores ``(B, h, T, S)`` from ``q (B, h, T, hs)``,
    ``k (B, h, S, hs)``, types ``(B, T)`` and ``(B, S)``."""
    m = _check(q, k, qtypes, ktypes, groups)
    nq = groups.shape[0]
    qa = q.unflatten(-1, (nq, m))  # (B, h, T, q, m)
    ka = k.unflatten(-1, (nq, m))  # (B, h, S, q, m)
    dots = torch.einsum("bhtam,bhsam->bhtsa", qa, ka)  # (B, h, T, S, q)
    use = groups.to(q.device)[qtypes[:, :, None], ktypes[:, None, :]]  # (B, T, S, q)
    scale = (use.sum(-1).to(q.dtype) * m).rsqrt()  # (B, T, S)
    return (dots * use[:, None].to(q.dtype)).sum(-1) * scale[:, None]


def _rows_scores(q: torch.Tensor, k: torch.Tensor, qt: torch.Tensor, kt: torch.Tensor,
                 groups: torch.Tensor, m: int) -> torch.Tensor:
    """Scores ``(B, h, T, S)`` for types ``qt (T,)``, ``kt (S,)`` shared by every row:
    one product per (query type, key type) block on its groups' columns."""
    nq = groups.shape[0]
    qperm, kperm = torch.argsort(qt, stable=True), torch.argsort(kt, stable=True)
    qn = torch.bincount(qt, minlength=nq).tolist()
    kn = torch.bincount(kt, minlength=nq).tolist()
    qs = q.index_select(2, qperm.to(q.device)).split(qn, dim=2)  # q x (B, h, T_i, hs)
    ks = k.index_select(2, kperm.to(k.device)).split(kn, dim=2)  # q x (B, h, S_j, hs)
    cols = torch.arange(nq * m, device=q.device).view(nq, m)
    rows = []
    for i in range(nq):
        if not qn[i]:
            continue
        blocks = []
        for j in range(nq):
            if not kn[j]:
                continue
            a = groups[i, j].nonzero().flatten().to(q.device)
            c = cols[a].flatten()  # the |F(i, j)| m columns
            s = qs[i].index_select(-1, c) @ ks[j].index_select(-1, c).transpose(-1, -2)
            blocks.append(s * (1.0 / math.sqrt(len(c))))  # (B, h, T_i, S_j)
        rows.append(torch.cat(blocks, dim=-1))
    sorted_scores = torch.cat(rows, dim=-2)  # (B, h, T, S) in type-sorted order
    qinv, kinv = torch.argsort(qperm).to(q.device), torch.argsort(kperm).to(q.device)
    return sorted_scores.index_select(-2, qinv).index_select(-1, kinv)


def structured_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         qtypes: torch.Tensor, ktypes: torch.Tensor, groups: torch.Tensor,
                         mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with structured scores: ``q (B, h, T, hs)``, ``k, v (B, h, S, hs)``,
    types ``(B, T)`` / ``(B, S)``, boolean ``mask`` broadcastable to ``(B, h, T, S)``
    (``True`` = attend; ``None`` = every key). Returns ``(B, h, T, hs)``."""
    m = _check(q, k, qtypes, ktypes, groups)
    groups = groups.cpu()
    qtc, ktc = qtypes.cpu(), ktypes.cpu()
    if bool((qtc == qtc[:1]).all()) and bool((ktc == ktc[:1]).all()):
        scores = _rows_scores(q, k, qtc[0], ktc[0], groups, m)  # (B, h, T, S)
    else:  # rows with their own types (left padding): one row at a time
        scores = torch.cat([_rows_scores(q[r:r + 1], k[r:r + 1], qtc[r], ktc[r], groups, m)
                            for r in range(q.shape[0])])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    low = scores.dtype in (torch.float16, torch.bfloat16)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32 if low else scores.dtype)
    probs = probs.to(v.dtype)  # (B, h, T, S)
    return probs @ v  # (B, h, T, hs)


def _pair_sizes(qtypes: torch.Tensor, ktypes: torch.Tensor, groups: torch.Tensor
                ) -> torch.Tensor:
    """``|F(type_p, type_u)|`` for every pair: ``(B, T, S)`` int64."""
    sizes = groups.sum(-1).cpu()  # (q, q)
    return sizes[qtypes.cpu()[:, :, None], ktypes.cpu()[:, None, :]]


def structured_score_macs(qtypes: torch.Tensor, ktypes: torch.Tensor, groups: torch.Tensor,
                          head_size: int, heads: int) -> int:
    """Score MACs :func:`structured_attention` executes (every computed pair, as dense
    attention computes every pair too): ``heads * sum |F(i, j)| m``; dense is
    ``heads * B * T * S * hs``."""
    m = head_size // groups.shape[0]
    return int(_pair_sizes(qtypes, ktypes, groups).sum()) * m * heads


def structured_rho(qtypes: torch.Tensor, ktypes: torch.Tensor, groups: torch.Tensor,
                   allowed: torch.Tensor | None = None) -> Fraction:
    """``rho_score``: score MACs over dense score MACs on the ``allowed`` pairs
    (``(B, T, S)`` bool; ``None`` = all). For ``Q_q`` this is the seed's
    ``(2M - M_=) / (q M)``."""
    sizes = _pair_sizes(qtypes, ktypes, groups)
    if allowed is not None:
        sizes = sizes[allowed.cpu().expand_as(sizes)]
    pairs = sizes.numel()
    if not pairs:
        raise ValueError("no allowed query-key pairs")
    return Fraction(int(sizes.sum()), groups.shape[0] * pairs)
