"""The seed's test-6 control methods: per-layer free factors from a plain-SVD start and
from a random start, at ``svd-llm-w``'s storage."""

from __future__ import annotations

import pytest
import torch

from structlm.hf.adapters import MatrixType, get_adapter
from structlm.hf.calibration import calibrate
from structlm.share.compress import CompressionConfig, compress_model
from structlm.share.compress.methods.lowrank_starts import factorize_lowrank_start
from tiny_models import tiny_llama


def _moments(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        a = torch.randn(97, 97, generator=g, dtype=torch.float64)
        out.append(a @ a.T / 97)
    return out


@pytest.mark.parametrize("parts", [1, 2])
def test_plain_svd_start_is_the_balanced_truncated_svd(parts: int) -> None:
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(14, 97, generator=g) for _ in range(2)]
    tf = factorize_lowrank_start(weights, _moments(2), 5, parts, "svd", "lowrank-svd")
    op = 14 // parts
    for w, e in zip(weights, tf.per_layer, strict=True):
        for p in range(parts):
            block = w[p * op:(p + 1) * op].double()
            U, S, Vh = torch.linalg.svd(block, full_matrices=False)
            best = (U[:, :5] * S[:5]) @ Vh[:5]
            torch.testing.assert_close(e[f"B{p}"] @ e[f"C{p}"], best)
            # balanced: both factors carry the square roots of the singular values
            torch.testing.assert_close(e[f"B{p}"].norm(dim=0), e[f"C{p}"].norm(dim=1))


def test_random_start_is_scaled_to_the_weight_and_drawn_per_seed() -> None:
    g = torch.Generator().manual_seed(2)
    weights = [3.0 * torch.randn(40, 97, generator=g) for _ in range(6)]
    torch.manual_seed(0)
    a = factorize_lowrank_start(weights, _moments(6), 7, 1, "random", "lowrank-random")
    torch.manual_seed(1)
    b = factorize_lowrank_start(weights, _moments(6), 7, 1, "random", "lowrank-random")
    assert not torch.equal(a.per_layer[0]["B0"], b.per_layer[0]["B0"])
    ratio = [float((e["B0"] @ e["C0"]).norm() / w.double().norm())
             for e, w in zip(a.per_layer, weights, strict=True)]
    assert 0.7 < sum(ratio) / len(ratio) < 1.3  # E||BC||² = ||W||²
    with pytest.raises(ValueError, match="start must be"):
        factorize_lowrank_start(weights, _moments(6), 7, 1, "zeros", "x")


def test_controls_store_what_whitened_truncation_stores() -> None:
    stored = {}
    for method in ("svd-llm-w", "lowrank-svd", "lowrank-random"):
        model = tiny_llama()
        adapter = get_adapter(model)
        ids = torch.randint(0, 89, (256,), generator=torch.Generator().manual_seed(1))
        cal = calibrate(adapter, ids, seq_len=32, batch_size=2, progress=False)
        torch.manual_seed(0)
        rep = compress_model(adapter, cal, CompressionConfig(method=method, types="q",
                                                             target_reduction=0.5))
        stored[method] = rep["stored_parameters"]
        assert rep["types"][MatrixType.Q.value]["method"] == method
    assert len(set(stored.values())) == 1
