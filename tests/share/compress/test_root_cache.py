"""The whitening roots' cache (keyed on the moment's content, bounded in memory, stored
on disk for wide inputs) and the kept-energy measure."""

from __future__ import annotations

import torch

from structlm.hf.linalg import psd_roots
from structlm.share.compress.factorize import RootCache, kept_energy


def _moment(d: int, seed: int) -> torch.Tensor:
    X = torch.randn(3 * d, d, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64)
    return X.T @ X / X.shape[0]


def test_roots_are_keyed_on_content_and_stored_for_wide_inputs(tmp_path) -> None:
    C = _moment(37, 0)
    cache = RootCache(1e-6, store=tmp_path, store_min_dim=16)
    S, S_inv = cache.get(C)
    want = psd_roots(C, 1e-6)
    torch.testing.assert_close(S, want[0])
    torch.testing.assert_close(S_inv, want[1])
    torch.testing.assert_close(S @ S, C)
    # the same content in another tensor object: no second eigh
    cache.get(C.clone())
    assert cache.computed == 1 and len(list(tmp_path.glob("*.safetensors"))) == 1
    # a new cache (another run) reads the stored roots
    again = RootCache(1e-6, store=tmp_path, store_min_dim=16)
    S2, _ = again.get(C.clone())
    assert again.computed == 0 and torch.equal(S2, S)
    # another floor is another key
    other = RootCache(1e-3, store=tmp_path, store_min_dim=16)
    other.get(C)
    assert other.computed == 1 and len(list(tmp_path.glob("*.safetensors"))) == 2
    # narrow inputs are not stored; a damaged file is recomputed, not trusted
    RootCache(1e-6, store=tmp_path, store_min_dim=38).get(_moment(37, 1))
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    for f in tmp_path.glob("*.safetensors"):
        f.write_bytes(b"damaged")
    fresh = RootCache(1e-6, store=tmp_path, store_min_dim=16)
    torch.testing.assert_close(fresh.get(C)[0], S)
    assert fresh.computed == 1


def test_bad_arguments_are_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="store_min_dim=0"):
        RootCache(1e-6, store_min_dim=0)
    with pytest.raises(ValueError, match="floor=-1"):
        RootCache(-1.0)


def test_memory_holds_at_most_its_budget_least_recent_dropped_first() -> None:
    Cs = [_moment(20, s) for s in range(4)]
    one = 2 * 20 * 20 * 8  # the two roots of one moment, bytes
    cache = RootCache(1e-6, memory_bytes=2 * one)
    for C in Cs[:3]:
        cache.get(C)
    assert cache.computed == 3
    cache.get(Cs[2])  # still held
    cache.get(Cs[1])
    assert cache.computed == 3
    cache.get(Cs[0])  # dropped first: computed again
    assert cache.computed == 4


def test_kept_energy_is_the_whitened_energy_share() -> None:
    """``1 − ||(W − Ŵ) C^{1/2}||² / ||W C^{1/2}||²`` for a PSD ``C``, at awkward shapes."""
    g = torch.Generator().manual_seed(3)
    for out, inn in ((1, 7), (97, 13), (7, 97)):
        C = _moment(inn, out)
        W = torch.randn(out, inn, generator=g, dtype=torch.float64)
        What = W + 0.3 * torch.randn(out, inn, generator=g, dtype=torch.float64)
        S = psd_roots(C, 0.0)[0]
        want = 1 - ((W - What) @ S).pow(2).sum() / (W @ S).pow(2).sum()
        assert abs(kept_energy(W, What, C) - float(want)) < 1e-9
        assert kept_energy(W, W.float(), C) > 1 - 1e-6
        assert kept_energy(W, torch.zeros_like(W), C) == 0.0
