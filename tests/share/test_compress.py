"""Compression methods on small random models with real calibration hooks: exactness at
full rank, honest accounting, budgets, save/load round trip."""

from __future__ import annotations

import pytest
import torch

from structlm.share.adapters import MatrixType, get_adapter
from structlm.share.calibration import calibrate
from structlm.share.compress import (
    METHODS,
    CompressionConfig,
    SharedBasisLinear,
    compress_model,
    factorize_type,
    load_compressed,
    rank_for_budget,
    save_compressed,
    solve_ranks,
    stored_parameters,
)
from structlm.share.loading import LoadedModel
from structlm.share.testing import tiny_llama


def _ids(n: int = 4 * 32, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 89, (n,), generator=torch.Generator().manual_seed(seed))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids(2 * 16, seed=9).view(2, 16)).logits


@pytest.mark.parametrize("method", METHODS)
def test_full_rank_reconstructs_exactly(method: str) -> None:
    g = torch.Generator().manual_seed(0)
    W = [torch.randn(16, 16, generator=g, dtype=torch.float64) for _ in range(4)]
    X = [torch.randn(200, 16, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3, 16)
         for _ in range(4)]
    Cs = [x.T @ x / 200 for x in X]
    tf = factorize_type(method, W, Cs, k=16, r=2, writer=False, floor=1e-12)
    assert min(tf.energy) > 1 - 1e-9, tf.energy


def test_low_rank_energy_is_ordered_and_hybrid_improves_shared() -> None:
    g = torch.Generator().manual_seed(1)
    W = [torch.randn(16, 24, generator=g, dtype=torch.float64) for _ in range(5)]
    Cs = [torch.eye(24, dtype=torch.float64) for _ in range(5)]
    shared = factorize_type("shared", W, Cs, k=6)
    hybrid = factorize_type("hybrid", W, Cs, k=6, r=3)
    svd = factorize_type("svd", W, Cs, k=6)
    assert all(h > s for h, s in zip(hybrid.energy, shared.energy, strict=True))
    assert all(v >= s - 1e-12 for v, s in zip(svd.energy, shared.energy, strict=True))
    assert 0 < min(hybrid.info["residual_share_of_basis_error"]) < 1


def test_budgets_and_accounting() -> None:
    assert stored_parameters("shared", 30, 576, 576, 144) == 144 * 1152 + 30 * 144 ** 2
    assert stored_parameters("svd", 12, 768, 768, 40) == 12 * 40 * 1536
    assert stored_parameters("onesided", 4, 10, 20, 3) == 3 * 20 + 4 * 3 * 10
    assert stored_parameters("onesided", 4, 10, 20, 3, writer=True) == 4 * 3 * 30
    budget = 0.6 * 30 * 576 * 576
    for m in METHODS:
        k = rank_for_budget(m, 30, 576, 576, budget, r=32)
        assert stored_parameters(m, 30, 576, 576, k, 32) <= budget
        assert k == 576 or stored_parameters(m, 30, 576, 576, k + 1, 32) > budget
    with pytest.raises(ValueError, match="unknown method 'pca'"):
        CompressionConfig(method="pca")
    with pytest.raises(ValueError, match="target_reduction must be in"):
        CompressionConfig(target_reduction=1.5)


@pytest.mark.parametrize("method", METHODS)
def test_compress_model_save_load_round_trip(method: str, tmp_path) -> None:
    model = tiny_llama()
    ad = get_adapter(model)
    cal = calibrate(ad, _ids(), seq_len=32, batch_size=2, progress=False)
    before = _logits(model)
    cfg = CompressionConfig(method=method, types="all", target_reduction=0.4, residual_rank=2)
    rep = compress_model(ad, cal, cfg)
    after = _logits(model)
    assert torch.isfinite(after).all() and not torch.allclose(after, before)
    assert rep["stored_parameters"] <= 0.6 * rep["original_parameters"] + 1
    # the accounting equals the tensors the model now holds
    held = sum(p.numel() for p in model.parameters())
    assert held == rep["model_parameters_after"]
    if method in ("shared", "hybrid"):
        assert isinstance(ad.layers[0].module(MatrixType.Q), SharedBasisLinear)
        assert ad.layers[0].module(MatrixType.Q).basis is ad.layers[2].module(MatrixType.Q).basis
    out = tmp_path / "compressed"
    save_compressed(LoadedModel(model, None, "tiny-llama", "", source="unused"), rep, out)
    # load_compressed rebuilds the source from its id: save a source folder to point at
    src = tmp_path / "source"
    tiny_llama().save_pretrained(src)
    manifest = (out / "structlm_compression.json")
    manifest.write_text(manifest.read_text().replace('"unused"', f'"{src}"'))
    back = load_compressed(out)
    torch.testing.assert_close(_logits(back.model), after, rtol=0, atol=0)


def test_pooled_budget_gives_capped_types_leftover_to_the_others() -> None:
    adapter = get_adapter(tiny_llama(num_hidden_layers=8, hidden_size=64,
                                     num_attention_heads=8, intermediate_size=96))
    L, shapes = 8, {"q": (64, 64), "k": (16, 64), "v": (16, 64), "o": (64, 64)}
    budget = 0.8 * L * sum(a * b for a, b in shapes.values())

    def stored(method: str, ranks: dict) -> int:
        return sum(stored_parameters(method, L, *shapes[t.value], k, 0,
                                     adapter.writes_residual(t)) for t, k in ranks.items())

    for method in ("shared", "svd", "onesided"):
        per = solve_ranks(adapter, CompressionConfig(method=method, target_reduction=0.2,
                                                     budget="per_type"))
        pooled = solve_ranks(adapter, CompressionConfig(method=method, target_reduction=0.2))
        assert stored(method, per) <= stored(method, pooled) <= budget
    per = solve_ranks(adapter, CompressionConfig(target_reduction=0.2, budget="per_type"))
    pooled = solve_ranks(adapter, CompressionConfig(target_reduction=0.2))
    assert per[MatrixType.K] == pooled[MatrixType.K] == 16  # capped at min(out, in)
    assert pooled[MatrixType.Q] > per[MatrixType.Q]  # the leftover went to Q and O
    assert stored("shared", pooled) > 0.97 * budget > 1.03 * stored("shared", per)
    with pytest.raises(ValueError, match="budget must be 'pooled' or 'per_type', got 'x'"):
        CompressionConfig(budget="x")
