"""Role signature: can a matrix's weights tell a residual-stream *writer* (O, MLP-out)
from a *reader* (Q, K, V, MLP-in)?

Features are computed in the fixed ``(out, in)`` orientation — never oriented by role,
which would leak the label — so a writer's residual side is its output side and a
reader's its input side: entry kurtosis and outlier ratio, row-norm and column-norm
spread (coefficient of variation, max/median, kurtosis), top singular value share and
stable rank. A logistic regression (scikit-learn, standardised features, balanced class
weights) is trained on attention matrices and tested on MLP matrices, and the reverse;
the p-value is a permutation test (training labels shuffled, refit, test accuracy at
least as high) and the majority-class rate is reported next to every accuracy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .linalg import singular_values

__all__ = ["FEATURE_NAMES", "role_features", "transfer_test"]

FEATURE_NAMES = ("entry_kurtosis", "log_max_over_rms", "row_norm_cv", "col_norm_cv",
                 "log_row_max_over_median", "log_col_max_over_median", "row_norm_kurtosis",
                 "col_norm_kurtosis", "top_singular_share", "stable_rank_fraction")


def _kurtosis(x: torch.Tensor) -> float:
    z = (x - x.mean()) / x.std().clamp_min(1e-300)
    return float(z.pow(4).mean() - 3.0)


def role_features(W: torch.Tensor) -> np.ndarray:
    """The :data:`FEATURE_NAMES` of one matrix ``(out, in)``."""
    W = W.double()
    rows, cols = W.norm(dim=1), W.norm(dim=0)
    rms = W.pow(2).mean().sqrt()
    s2 = singular_values(W).pow(2)
    feats = [
        np.log1p(max(_kurtosis(W.flatten()), -0.999) + 1.0),
        float((W.abs().max() / rms).log()),
        float(rows.std() / rows.mean()), float(cols.std() / cols.mean()),
        float((rows.max() / rows.median()).log()), float((cols.max() / cols.median()).log()),
        np.log1p(max(_kurtosis(rows), -0.999) + 1.0),
        np.log1p(max(_kurtosis(cols), -0.999) + 1.0),
        float(s2[0] / s2.sum()), float(s2.sum() / s2[0] / s2.numel()),
    ]
    return np.asarray(feats, dtype=np.float64)


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
