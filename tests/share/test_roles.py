"""The role classifier on synthetic matrices with a planted residual-side signature."""

from __future__ import annotations

import numpy as np
import torch

from structlm.share.roles import FEATURE_NAMES, role_features, transfer_test


def _matrix(out: int, inn: int, writer: bool, g: torch.Generator) -> torch.Tensor:
    """Gaussian matrix whose residual side (output for writers, input for readers) has a
    few outlier dimensions of random strength."""
    W = torch.randn(out, inn, generator=g, dtype=torch.float64)
    strength = 4 + 4 * torch.rand(3, generator=g, dtype=torch.float64)
    if writer:
        W[:3] *= strength[:, None]
    else:
        W[:, :3] *= strength
    return W


def _set(shapes: list[tuple[int, int, bool]], g: torch.Generator
         ) -> tuple[np.ndarray, np.ndarray]:
    X = np.stack([role_features(_matrix(o, i, w, g)) for o, i, w in shapes])
    return X, np.array([int(w) for _, _, w in shapes])


def test_planted_signature_transfers_and_shuffled_labels_do_not() -> None:
    g = torch.Generator().manual_seed(0)
    attn = [(48, 48, t == "o") for _ in range(20) for t in "qkvo"]
    mlp = [(96, 48, False) for _ in range(10)] + [(48, 96, True) for _ in range(10)]
    Xa, ya = _set(attn, g)
    Xm, ym = _set(mlp, g)
    assert Xa.shape == (80, len(FEATURE_NAMES)) and np.isfinite(Xa).all()
    res = transfer_test(Xa, ya, Xm, ym, permutations=100)
    assert res["accuracy"] >= 0.9 and res["p_value"] < 0.05
    assert res["majority_rate"] == 0.5
    rng = np.random.default_rng(0)
    shuffled = transfer_test(Xa, rng.permutation(ya), Xm, ym, permutations=20)
    assert shuffled["accuracy"] < res["accuracy"]


def test_features_do_not_depend_on_scale() -> None:
    g = torch.Generator().manual_seed(1)
    W = _matrix(40, 30, True, g)
    np.testing.assert_allclose(role_features(W), role_features(7.5 * W), rtol=1e-9, atol=1e-12)
