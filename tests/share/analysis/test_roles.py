"""The role classifier on synthetic matrices: a planted residual-side signature, features
free of the matrix shape, and the shape-only control."""

from __future__ import annotations

import numpy as np
import torch

from structlm.share.analysis.roles import (
    FEATURE_NAMES,
    SHAPE_FEATURE_NAMES,
    role_features,
    shape_features,
    transfer_test,
)


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


def test_gaussian_features_carry_no_shape_information() -> None:
    """Gaussian matrices of one entry variance and very different shapes (attention-like
    1:3, MLP-like 8:3 and 3:8, square) have (close to) equal features — the features a
    raw stable rank / top singular share / max-over-rms would have split by shape."""
    g = torch.Generator().manual_seed(2)
    shapes = [(128, 384), (384, 384), (1024, 384), (384, 1024)]
    mean = {s: np.mean([role_features(0.02 * torch.randn(*s, generator=g,
                                                         dtype=torch.float64))
                        for _ in range(4)], axis=0) for s in shapes}
    # sampling noise of a kurtosis of 128 values is larger than of the other features
    atol = np.array([0.02 if "norm_kurtosis" not in n else 0.3 for n in FEATURE_NAMES])
    for s in shapes[1:]:
        np.testing.assert_array_less(np.abs(mean[s] - mean[shapes[0]]), atol)
    expected = {"row_scale_dispersion": 0.0, "col_scale_dispersion": 0.0,
                "top_singular_over_mp_edge": 0.0, "participation_ratio_over_mp": 1.0,
                "entry_kurtosis": float(np.log(2.0))}
    for s in shapes:
        for name, value in expected.items():
            assert abs(mean[s][FEATURE_NAMES.index(name)] - value) < 0.02, (s, name)
    np.testing.assert_allclose(shape_features(torch.zeros(3, 4)), [3, 4, 0.75])
    np.testing.assert_allclose(shape_features((3072, 576)), [3072, 576, 3072 / 576])


def test_shape_only_control_catches_a_shape_confound() -> None:
    """Writers wide and readers tall in both families, no planted signature (plain
    Gaussian matrices): the shapes alone transfer perfectly; the shape-free features
    do not."""
    g = torch.Generator().manual_seed(3)

    def family(n: int, writer_shape: tuple[int, int], reader_shape: tuple[int, int]
               ) -> tuple[list[torch.Tensor], np.ndarray]:
        mats = [torch.randn(*writer_shape, generator=g, dtype=torch.float64) for _ in range(n)]
        mats += [torch.randn(*reader_shape, generator=g, dtype=torch.float64)
                 for _ in range(n)]
        return mats, np.array([1] * n + [0] * n)

    attn, ya = family(12, (32, 64), (64, 32))
    mlp, ym = family(12, (40, 120), (120, 40))
    shape = transfer_test(np.stack([shape_features(W) for W in attn]), ya,
                          np.stack([shape_features(W) for W in mlp]), ym, permutations=50)
    real = transfer_test(np.stack([role_features(W) for W in attn]), ya,
                         np.stack([role_features(W) for W in mlp]), ym, permutations=50)
    assert shape["accuracy"] == 1.0  # (two distinct training shapes: p is uninformative)
    assert real["accuracy"] < 0.85 and real["p_value"] > 0.05


def test_role_test_reports_the_shape_only_control() -> None:
    from structlm.hf.adapters import get_adapter
    from structlm.share.analysis.analyze import Thresholds, _role_test
    from tiny_models import tiny_llama

    adapter = get_adapter(tiny_llama())
    res = _role_test(lambda t: dict(enumerate(adapter.weights(t, [0, 1, 2]))),
                     adapter.writes_residual, 20, 0, Thresholds())
    assert res["features"] == list(FEATURE_NAMES)
    assert res["shape_only"]["features"] == list(SHAPE_FEATURE_NAMES)
    for part in (res, res["shape_only"]):
        for key in ("attention_to_mlp", "mlp_to_attention"):
            r = part[key]
            assert 0 <= r["accuracy"] <= 1 and isinstance(r["transfers"], bool)
            assert r["n_train"] + r["n_test"] == 18
