"""The in-place symmetric eigen-decomposition and the roots formed from it, against
``torch.linalg.eigh`` and the plain formulas."""

from __future__ import annotations

import pytest
import torch

from structlm.hf.linalg import psd_inv_sqrt, psd_roots, psd_sqrt, symmetric_eigh_, thin_svd


def _psd(n: int, seed: int, rank: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, rank or n + 3, generator=g, dtype=torch.float64)
    return X @ X.T / X.shape[1]


@pytest.mark.parametrize("n", [1, 7, 97, 1025])
def test_symmetric_eigh_matches_torch(n: int) -> None:
    C = _psd(n, n)
    e_ref, V_ref = torch.linalg.eigh(C)
    e, V = symmetric_eigh_(C.clone())
    assert e.dtype == V.dtype == torch.float64 and V.shape == (n, n)
    torch.testing.assert_close(e, e_ref, rtol=1e-10, atol=1e-12 * float(e_ref.abs().max()))
    # eigenvectors up to sign: compare the projectors V diag(e) Vᵀ and orthonormality
    torch.testing.assert_close((V * e) @ V.T, C, rtol=0, atol=1e-10 * float(C.abs().max()))
    torch.testing.assert_close(V.T @ V, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-10)
    # the eigenvalues are distinct: each eigenvector equals torch's up to its sign
    torch.testing.assert_close((V * V_ref).sum(0).abs(), torch.ones(n, dtype=torch.float64),
                               rtol=0, atol=1e-6)


def test_symmetric_eigh_consumes_its_input_in_place() -> None:
    C = _psd(64, 1)
    A = C.clone()
    ptr = A.data_ptr()
    _, V = symmetric_eigh_(A)
    assert V.data_ptr() == ptr  # the eigenvectors are written over A's storage
    assert not torch.equal(A, C)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_symmetric_eigh_refuses_non_finite(bad: float) -> None:
    C = _psd(9, 2)
    C[3, 4] = C[4, 3] = bad
    with pytest.raises(torch.linalg.LinAlgError, match="non-finite"):
        symmetric_eigh_(C)


def test_symmetric_eigh_refuses_wrong_input() -> None:
    with pytest.raises(ValueError, match="square"):
        symmetric_eigh_(torch.ones(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="float64"):
        symmetric_eigh_(_psd(5, 3).float())


@pytest.mark.parametrize("n", [1, 7, 97, 1025, 2049])  # 2,049: over two row blocks + 1
def test_psd_roots_match_the_plain_formula(n: int) -> None:
    C = _psd(n, 10 + n, rank=max(1, n // 2))  # rank-deficient: the floor acts
    C_before = C.clone()
    floor = 1e-6
    e, V = torch.linalg.eigh(0.5 * (C + C.T))
    e = e.clamp_min(max(floor * float(e.max()), 1e-300))
    root_ref, inv_ref = (V * e.sqrt()) @ V.T, (V * e.rsqrt()) @ V.T
    root, inv = psd_roots(C, floor)
    assert torch.equal(C, C_before)  # the caller's moment is not consumed
    scale = float(root_ref.abs().max())
    torch.testing.assert_close(root, root_ref, rtol=0, atol=1e-9 * scale)
    torch.testing.assert_close(inv, inv_ref, rtol=0, atol=1e-9 * float(inv_ref.abs().max()))
    torch.testing.assert_close(root @ inv, torch.eye(n, dtype=torch.float64), rtol=0,
                               atol=1e-7)
    torch.testing.assert_close(psd_sqrt(C, floor), root, rtol=0, atol=1e-9 * scale)
    torch.testing.assert_close(psd_inv_sqrt(C, floor), inv, rtol=0,
                               atol=1e-9 * float(inv.abs().max()))


@pytest.mark.parametrize("shape", [(1, 5), (7, 97), (97, 7), (300, 1025)])
def test_thin_svd_matches_torch(shape: tuple[int, int]) -> None:
    W = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)),
                    dtype=torch.float64)
    U, S, Vh = thin_svd(W)
    S_ref = torch.linalg.svdvals(W)
    torch.testing.assert_close(S, S_ref, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close((U * S) @ Vh, W, rtol=0, atol=1e-9)


@pytest.mark.parametrize("n", [1, 7, 97, 1025, 2049])
def test_psd_roots_consuming_the_moment_are_bitwise_the_same(n: int) -> None:
    """``consume=True`` symmetrises and decomposes ``C`` in its own storage (by block
    pairs): the roots are bitwise those of the copying path, and ``C`` is overwritten."""
    C = _psd(n, 40 + n, rank=max(1, n // 3))
    C += 1e-9 * torch.randn(n, n, generator=torch.Generator().manual_seed(n),
                            dtype=torch.float64)  # not exactly symmetric: averaging acts
    ref = psd_roots(C, 1e-6)
    owned = C.clone()
    got = psd_roots(owned, 1e-6, consume=True)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    if n > 1:
        assert not torch.equal(owned, C)  # the caller's copy became the eigenvectors
    f32 = C.float()  # not float64: a float64 copy is made, the input left alone
    f32_before = f32.clone()
    psd_roots(f32, 1e-6, consume=True)
    assert torch.equal(f32, f32_before)
