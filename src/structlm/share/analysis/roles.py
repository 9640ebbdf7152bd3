"""Role signature: can a matrix's weights tell a residual-stream *writer* (O, MLP-out)
from a *reader* (Q, K, V, MLP-in)?

Features are computed in the fixed ``(out, in)`` orientation — never oriented by role,
which would leak the label — so a writer's residual side is its output side (rows) and a
reader's its input side (columns). They must not encode the matrix's *shape* either:
shape alone separates attention (576×576, 192×576 in SmolLM2) from MLP (3072×576,
576×1536), and with it the writers of one family from the readers of the other. Every
feature is therefore a ratio whose expectation for a matrix of independent Gaussian
entries is the same for every shape and scale, up to small finite-size corrections
(tested):

* ``entry_kurtosis``: ``log(2 + excess kurtosis)`` of the entries;
* ``entry_tail_ratio``: ``log(q99.9(|w|) / rms)`` — a quantile, not the maximum, whose
  expectation grows with the number of entries;
* ``row_scale_dispersion`` / ``col_scale_dispersion``: the squared coefficient of
  variation of the squared row (column) norms minus what independent entries give,
  ``(κ + 2)/n`` (``n`` entries per row, ``κ`` their excess kurtosis measured after each
  row is divided by its RMS), computed after the other side's scales are divided out —
  0 for any i.i.d. matrix, the variance of the squared row (column) scales otherwise;
* ``row_norm_kurtosis`` / ``col_norm_kurtosis``: ``log(2 + excess kurtosis)`` of those
  norms (outlier rows / columns);
* ``top_singular_over_mp_edge``: ``log(σ_max / (rms·(√out + √in)))`` — the top singular
  value against the Marchenko–Pastur edge of a random matrix of the same shape and
  entry variance (0 for Gaussian matrices; a raw top singular share or a stable rank
  over ``min(out, in)`` would depend on the shape);
* ``participation_ratio_over_mp``: ``(Σσ²)² / Σσ⁴`` over its Gaussian (Wishart)
  expectation ``p n / (n + p + 1)`` (``p = min(out, in)``, ``n = max``): 1 for
  Gaussian matrices, below 1 when a few directions dominate.

A logistic regression (scikit-learn, standardised features, balanced class weights) is
trained on attention matrices and tested on MLP matrices, and the reverse; the p-value
is a permutation test (training labels shuffled, refit, test accuracy at least as high)
and the majority-class rate is reported next to every accuracy. A **shape-only control**
(:func:`shape_features`: ``out``, ``in``, ``out/in``) goes through the same transfer
test, so a reader sees what the shapes alone would have scored.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from structlm.hf.linalg import singular_values

__all__ = ["FEATURE_NAMES", "SHAPE_FEATURE_NAMES", "role_features", "shape_features",
           "transfer_test"]

FEATURE_NAMES = ("entry_kurtosis", "entry_tail_ratio", "row_scale_dispersion",
                 "col_scale_dispersion", "row_norm_kurtosis", "col_norm_kurtosis",
                 "top_singular_over_mp_edge", "participation_ratio_over_mp")

SHAPE_FEATURE_NAMES = ("out", "in", "out_over_in")

TAIL_QUANTILE = 0.999


def _kurtosis(x: torch.Tensor) -> float:
    z = (x - x.mean()) / x.std().clamp_min(1e-300)
    return float(z.pow(4).mean() - 3.0)


def _log_kurtosis(x: torch.Tensor) -> float:
    return float(np.log(max(_kurtosis(x), -1.999) + 2.0))


def _scale_dispersion(W: torch.Tensor) -> float:
    """Squared CV of the squared row norms of ``W`` minus the i.i.d. expectation
    ``(κ + 2)/n`` (``κ``: excess kurtosis of the entries of the row-normalised matrix)."""
    r = W.pow(2).sum(1)
    n = W.shape[1]
    cv2 = float(r.var(unbiased=False) / r.mean().pow(2).clamp_min(1e-300))
    Z = W / (r / n).sqrt().clamp_min(1e-300)[:, None]
    kappa = float(Z.pow(4).mean() / Z.pow(2).mean().pow(2).clamp_min(1e-300)) - 3.0
    return cv2 - (kappa + 2.0) / n


def role_features(W: torch.Tensor) -> np.ndarray:
    """The :data:`FEATURE_NAMES` of one matrix ``(out, in)`` (float64; invariant to the
    overall scale, and free of the shape for i.i.d. Gaussian matrices)."""
    W = W.double()
    out, inn = W.shape
    rms = W.pow(2).mean().sqrt().clamp_min(1e-300)
    flat = W.abs().flatten()
    k = max(1, min(flat.numel(), int(np.ceil(TAIL_QUANTILE * flat.numel()))))
    tail = flat.kthvalue(k).values
    # each side's scales measured after dividing out the other side's
    col_rms = W.pow(2).mean(0).sqrt().clamp_min(1e-300)
    row_rms = W.pow(2).mean(1).sqrt().clamp_min(1e-300)
    Wc = W / col_rms  # column scales removed: rows of a writer keep their outliers
    Wr = W / row_rms[:, None]
    s2 = singular_values(W).pow(2)
    p, n = min(out, inn), max(out, inn)
    participation = float(s2.sum().pow(2) / s2.pow(2).sum().clamp_min(1e-300))
    feats = [
        _log_kurtosis(W.flatten()),
        float((tail / rms).clamp_min(1e-300).log()),
        _scale_dispersion(Wc), _scale_dispersion(Wr.T),
        _log_kurtosis(Wc.norm(dim=1)), _log_kurtosis(Wr.norm(dim=0)),
        float((s2[0].sqrt() / (rms * (out ** 0.5 + inn ** 0.5))).log()),
        participation * (n + p + 1) / (p * n),
    ]
    return np.asarray(feats, dtype=np.float64)


def shape_features(W: torch.Tensor | tuple[int, int]) -> np.ndarray:
    """The :data:`SHAPE_FEATURE_NAMES` (``out``, ``in``, ``out/in``) of a matrix or a
    shape — the shape-only control's features."""
    out, inn = (W.shape if isinstance(W, torch.Tensor) else W)[:2]
    return np.asarray([out, inn, out / inn], dtype=np.float64)


def _fit_score(Xtr: np.ndarray, ytr: np.ndarray, Xte: np.ndarray, yte: np.ndarray) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    clf = make_pipeline(StandardScaler(), LogisticRegression(class_weight="balanced",
                                                             max_iter=2000))
    clf.fit(Xtr, ytr)
    return float((clf.predict(Xte) == yte).mean())


def transfer_test(Xtr: np.ndarray, ytr: np.ndarray, Xte: np.ndarray, yte: np.ndarray,
                  permutations: int = 500, seed: int = 0) -> dict[str, Any]:
    """Train on (``Xtr``, ``ytr``), test on (``Xte``, ``yte``); 1 = writer."""
    if len(set(ytr.tolist())) < 2:
        raise ValueError("the training set needs both writers and readers")
    acc = _fit_score(Xtr, ytr, Xte, yte)
    rng = np.random.default_rng(seed)
    null = [_fit_score(Xtr, rng.permutation(ytr), Xte, yte) for _ in range(permutations)]
    ge = sum(a >= acc for a in null)
    majority = max(float(yte.mean()), 1.0 - float(yte.mean()))
    return {"accuracy": acc, "majority_rate": majority, "p_value": (1 + ge) / (1 + permutations),
            "permutations": permutations, "n_train": len(ytr), "n_test": len(yte),
            "null_mean_accuracy": float(np.mean(null))}
