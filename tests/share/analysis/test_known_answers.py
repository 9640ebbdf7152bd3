"""Known-answer tests of tests 1–3 on synthetic matrices, and the linear algebra."""

from __future__ import annotations

import pytest
import torch

from structlm.hf.linalg import (
    effective_rank,
    energy_weighted_basis,
    psd_inv_sqrt,
    psd_sqrt,
    random_like_spectrum,
    random_orthonormal,
    subspace_overlap,
    top_eigenvectors_,
)
from structlm.share.analysis.alignment import align, drop_split
from structlm.share.analysis.analyze import Thresholds, _alignment_test, _subspace_test
from structlm.share.analysis.subspaces import functional_matrices, per_side_k, subspace_scores


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_permuted_and_scaled_copy_aligns_to_zero() -> None:
    g = _gen()
    R = torch.randn(97, 61, generator=g, dtype=torch.float64)
    rows, cols = torch.randperm(97, generator=g), torch.randperm(61, generator=g)
    dr = 0.5 + torch.rand(97, 1, generator=g, dtype=torch.float64)
    dc = 0.5 + torch.rand(61, generator=g, dtype=torch.float64)
    W = 3.0 * R[rows][:, cols] * dr * dc
    res = align(R, W)
    assert res["raw"] > 1.0 and res["scale"] > 0.9  # nothing without the moves
    assert res["perm_diag"] < 1e-10
    assert res["rot2"] < res["scale"]


def test_rotated_copy_aligns_with_rotations_only() -> None:
    g = _gen(1)
    R = torch.randn(40, 64, generator=g, dtype=torch.float64)
    rot = random_orthonormal(64, 64, g)
    res = align(R, 0.1 * R @ rot)
    assert res["rot1"] < 1e-10 and res["rot2"] < 1e-10
    assert res["perm_diag"] > 0.5
    P = random_orthonormal(40, 40, g)
    res2 = align(R, P @ R @ rot)
    assert res2["rot2"] < 1e-10 and res2["rot1"] > 0.1


def test_random_matrices_do_not_align_and_residuals_are_ordered() -> None:
    g = _gen(2)
    R, W = (torch.randn(64, 48, generator=g, dtype=torch.float64) for _ in range(2))
    res = align(R, W)
    assert res["scale"] > 0.95 and res["perm_diag"] > 0.8
    assert res["scale"] >= res["perm"] - 1e-9 >= res["perm_diag"] - 2e-9 >= 0
    assert res["scale"] >= res["rot1"] >= res["rot2"] - 1e-12
    with pytest.raises(ValueError, match="cannot align"):
        align(R, W.T)


def test_one_sided_procrustes_matches_brute_force_both_shapes() -> None:
    g = _gen(3)
    for shape in ((30, 50), (50, 30)):
        R, W = (torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(2))
        U, _, Vh = torch.linalg.svd(W.T @ R)
        WO = W @ (U @ Vh)
        s = (R * WO).sum() / WO.pow(2).sum()
        brute = float((R - s * WO).pow(2).sum() / R.pow(2).sum())
        assert align(R, W)["rot1"] == pytest.approx(brute, abs=1e-10)


def _shared_layers(n: int, out: int, inn: int, k: int, g: torch.Generator
                   ) -> list[torch.Tensor]:
    U, V = random_orthonormal(out, k, g), random_orthonormal(inn, k, g)
    return [U @ torch.randn(k, k, generator=g, dtype=torch.float64) @ V.T for _ in range(n)]


def test_exactly_shared_subspace_scores_one_and_random_scores_zero() -> None:
    g = _gen(4)
    mats = _shared_layers(6, 48, 40, 8, g)
    for side in ("input", "output"):
        res = subspace_scores(mats, 8, side, g)
        assert res["score"] == pytest.approx(1.0, abs=1e-9)
        assert res["overlap_all_pairs"] == pytest.approx(1.0, abs=1e-9)
        assert max(res["effective_rank"]) <= 8
    rnd = [torch.randn(48, 40, generator=g, dtype=torch.float64) for _ in range(6)]
    few = subspace_scores(rnd, 8, "input", g)["score"]
    rnd += [torch.randn(48, 40, generator=g, dtype=torch.float64) for _ in range(34)]
    res = subspace_scores(rnd, 8, "input", g)
    # the in-sample fit buys random matrices a score that shrinks with the layer count
    # (why every test also runs a null control through the same procedure)
    assert abs(res["score"]) < 0.2 < few < 0.5
    assert res["overlap_all_pairs"] == pytest.approx(8 / 40, abs=0.1)


def test_functional_matrices_reveal_subspaces_hidden_by_the_inputs() -> None:
    """Random weights read inputs that live in a shared 6-dim subspace: the weight test
    sees nothing, the functional test sees the shared input subspace."""
    g = _gen(5)
    B = random_orthonormal(40, 6, g)
    C = B @ torch.diag(torch.linspace(1, 2, 6, dtype=torch.float64)) @ B.T + 1e-6 * torch.eye(40)
    W = [torch.randn(32, 40, generator=g, dtype=torch.float64) for _ in range(5)]
    M = functional_matrices(W, [psd_sqrt(C)] * 5)
    assert subspace_scores(W, 6, "input", g)["score"] < 0.5
    assert subspace_scores(M, 6, "input", g)["score"] > 0.99
    assert max(effective_rank(m) for m in M) <= 6


def test_psd_roots_and_spectrum_null() -> None:
    g = _gen(6)
    A = torch.randn(30, 30, generator=g, dtype=torch.float64)
    C = A @ A.T + 0.1 * torch.eye(30, dtype=torch.float64)
    S = psd_sqrt(C)
    torch.testing.assert_close(S @ S, C)
    torch.testing.assert_close(psd_inv_sqrt(C) @ C @ psd_inv_sqrt(C),
                               torch.eye(30, dtype=torch.float64))
    W = torch.randn(20, 35, generator=g, dtype=torch.float64)
    N = random_like_spectrum(W, g)
    torch.testing.assert_close(torch.linalg.svdvals(N), torch.linalg.svdvals(W))
    assert (N - W).norm() > W.norm()


def test_stacked_gated_rows_move_together() -> None:
    """A stacked [gate; up] whose hidden units (row i of both blocks) are permuted
    together aligns to zero with row_blocks=2."""
    g = _gen(7)
    R = torch.randn(2 * 23, 17, generator=g, dtype=torch.float64)
    perm, cols = torch.randperm(23, generator=g), torch.randperm(17, generator=g)
    W = torch.cat([R[:23][perm], R[23:][perm]])[:, cols] * 2.0
    assert align(R, W, row_blocks=2)["perm_diag"] < 1e-10
    with pytest.raises(ValueError, match="row_blocks=3 must divide"):
        align(R, W, row_blocks=3)


class _NoBar:
    def update(self, _n: int) -> None:
        pass


def test_two_random_matrices_raw_residual_is_two_but_drop_from_scale_is_small() -> None:
    """Why the cheap-move drop is measured from ``scale``: two independent Gaussian
    matrices of equal norm have a raw residual ≈ 2 and a scale residual ≈ 1, so almost
    all of a raw → perm_diag drop is 'norm scaling' for any pair of matrices."""
    g = _gen(8)
    R = torch.randn(64, 48, generator=g, dtype=torch.float64)
    W = torch.randn(64, 48, generator=g, dtype=torch.float64)
    W = W * (R.norm() / W.norm())
    res = align(R, W)
    assert res["raw"] == pytest.approx(2.0, abs=0.1)
    split = drop_split([res])
    assert 0 <= split["total"] < 0.2
    assert split["total"] == pytest.approx(split["permutation"] + split["diagonal"], abs=1e-12)


def test_drop_split_attributes_permutations_and_diagonals() -> None:
    """A permuted copy drops entirely in the permutation part; a diagonally scaled copy
    entirely in the diagonal part."""
    g = _gen(9)
    R = torch.randn(50, 40, generator=g, dtype=torch.float64)
    rows, cols = torch.randperm(50, generator=g), torch.randperm(40, generator=g)
    permuted = align(R, 2.0 * R[rows][:, cols])
    dr = 0.3 + 1.4 * torch.rand(50, 1, generator=g, dtype=torch.float64)
    dc = 0.3 + 1.4 * torch.rand(40, generator=g, dtype=torch.float64)
    scaled = align(R, R * dr * dc)
    sp, sd = drop_split([permuted]), drop_split([scaled])
    assert permuted["scale"] > 0.9
    assert sp["permutation"] == pytest.approx(permuted["scale"], abs=1e-9)
    assert sp["diagonal"] == pytest.approx(0.0, abs=1e-9)
    assert sp["permutation_share"] == pytest.approx(1.0, abs=1e-9)
    assert scaled["scale"] > 0.01  # the diagonal scalings really cost something
    assert sd["permutation"] == pytest.approx(0.0, abs=1e-12)
    assert sd["diagonal"] == pytest.approx(scaled["scale"], abs=1e-9)
    assert sd["permutation_share"] == pytest.approx(0.0, abs=1e-12)
    # medians over layers, share from the sums
    both = drop_split([permuted, scaled, permuted])
    assert both["permutation"] == pytest.approx(permuted["scale"], abs=1e-9)
    assert both["diagonal"] == pytest.approx(0.0, abs=1e-9)


def test_alignment_test_reports_the_split_with_both_nulls_beside_it() -> None:
    g = _gen(10)
    R = torch.randn(40, 30, generator=g, dtype=torch.float64)
    weights = {0: R}
    for layer in (1, 2, 3):
        rows, cols = torch.randperm(40, generator=g), torch.randperm(30, generator=g)
        weights[layer] = (R[rows][:, cols] * (0.5 + torch.rand(40, 1, generator=g,
                                                                dtype=torch.float64)))
    res = _alignment_test(weights, 0, g, Thresholds(), _NoBar())
    assert "norm_scaling_share_of_cheap_drop" not in res
    drops = res["cheap_drop"]
    assert drops["baseline"] == "scale"
    for kind in ("real", "null_gaussian", "null_spectrum"):
        assert set(drops[kind]) == {"total", "permutation", "diagonal", "permutation_share"}
    assert drops["real"]["total"] > 0.9 and drops["real"]["permutation"] > 0.8
    assert drops["null_gaussian"]["total"] < 0.2 and drops["null_spectrum"]["total"] < 0.2
    assert drops["excess_over_gaussian"]["total"] == pytest.approx(
        drops["real"]["total"] - drops["null_gaussian"]["total"])
    assert res["median"]["real"]["perm_diag"] < 1e-8 and res["verdict"] == "lives"


def test_per_side_k_follows_each_side_including_gqa_shapes() -> None:
    assert per_side_k((192, 576), 0.25) == {"output": 48, "input": 144}  # SmolLM2 K/V
    assert per_side_k((576, 576), 0.25) == {"output": 144, "input": 144}
    assert per_side_k((3072, 576), 0.25) == {"output": 768, "input": 144}
    assert per_side_k((576, 1536), 0.25) == {"output": 144, "input": 384}
    with pytest.raises(ValueError, match="k_fraction"):
        per_side_k((8, 8), 1.0)


def test_gqa_shaped_sharing_needs_per_side_k() -> None:
    """K/V-like (48×144) layers whose rows live in one shared 36-dim input subspace (each
    layer's own 12-dim row space a different part of it) and whose columns share a
    12-dim output subspace: with per-side k (12 out, 36 in) both sides score 1; the old
    ``min(out, in)/4`` = 12 on the input side misses most of the shared input subspace."""
    g = _gen(11)
    U, V = random_orthonormal(48, 12, g), random_orthonormal(144, 36, g)
    mats = [U @ torch.randn(12, 36, generator=g, dtype=torch.float64) @ V.T
            for _ in range(8)]
    ks = per_side_k(mats[0].shape, 0.25)
    state = g.get_state()
    res = _subspace_test(mats, mats, ks, (48, 144), g, Thresholds(), 0.9)
    assert (res["k_input"], res["k_output"]) == (36, 12)
    # matrices built on demand (a function per kind) give the same numbers
    lazy = _subspace_test(lambda: list(mats), lambda: list(mats), ks, (48, 144),
                          torch.Generator().set_state(state), Thresholds(), 0.9)
    assert lazy == res
    assert res["input"]["real"]["score"] == pytest.approx(1.0, abs=1e-9)
    assert res["output"]["real"]["score"] == pytest.approx(1.0, abs=1e-9)
    assert subspace_scores(mats, 12, "input", g)["score"] < 0.7


def test_k_above_the_rank_on_a_tall_matrix() -> None:
    """Output side of a tall (MLP-in-like) matrix with k_out > in: the own subspace is
    the whole column space; layers sharing one column space score 1, random ones ~0."""
    g = _gen(12)
    U = random_orthonormal(96, 16, g)
    shared = [U @ torch.randn(16, 16, generator=g, dtype=torch.float64) for _ in range(6)]
    res = subspace_scores(shared, 24, "output", g)
    assert res["k_own"] == 16 and res["overlap_chance"] == pytest.approx(16 / 96)
    assert res["own"] == pytest.approx([1.0] * 6)
    assert res["score"] == pytest.approx(1.0, abs=1e-9)
    assert res["overlap_all_pairs"] == pytest.approx(1.0, abs=1e-9)
    rnd = [torch.randn(96, 16, generator=g, dtype=torch.float64) for _ in range(40)]
    assert abs(subspace_scores(rnd, 24, "output", g)["score"]) < 0.25


def test_shared_basis_through_the_small_gram_matches_the_direct_one() -> None:
    """Few tall layers (12 × 40 = 480 stacked rows < 1100 output dimensions, k = 200 so
    the Krylov span would be wider than 1100): the basis from the small Gram ``A Aᵀ`` is
    orthonormal and spans the top-k eigenvectors of ``Σ W Wᵀ``."""
    g = _gen(13)
    scales = torch.linspace(0.2, 3.0, 40, dtype=torch.float64)
    mats = [torch.randn(1100, 40, generator=g, dtype=torch.float64) * scales
            for _ in range(12)]
    B = energy_weighted_basis(mats, 200, "output")
    torch.testing.assert_close(B.T @ B, torch.eye(200, dtype=torch.float64))
    top = torch.linalg.eigh(sum(W @ W.T for W in mats))[1][:, -200:]
    assert subspace_overlap(B, top) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("dim", [1, 7, 97, 1025])
def test_top_eigenvectors_match_torch_eigh_and_consume_the_gram(dim: int) -> None:
    """The in-place MRRR path (``top_eigenvectors_``, used by the explicit shared-basis
    path to halve its peak memory) gives ``torch.linalg.eigh``'s top eigenvectors: the
    same Rayleigh quotients in decreasing order, orthonormal, spanning the same subspace
    where the spectrum has a gap; ``G`` is consumed."""
    g = _gen(dim)
    A = torch.randn(dim, dim + 3, generator=g, dtype=torch.float64)
    G = A @ A.T
    ref = G.clone()
    evals, evecs = torch.linalg.eigh(ref)
    for k in sorted({1, max(1, dim // 3), dim}):
        Gk = ref.clone()
        V = top_eigenvectors_(Gk, k)
        assert V.shape == (dim, k) and Gk.numel() == 0
        torch.testing.assert_close(V.T @ V, torch.eye(k, dtype=torch.float64), atol=1e-10,
                                   rtol=0)
        quotients = (V.T @ ref @ V).diagonal()
        torch.testing.assert_close(quotients, evals.flip(0)[:k], atol=1e-9 * float(evals[-1]),
                                   rtol=1e-10)
        assert subspace_overlap(V, evecs[:, -k:]) == pytest.approx(1.0, abs=1e-9)


def test_top_eigenvectors_of_a_rank_deficient_gram_are_orthonormal() -> None:
    """A Gram matrix of rank 50 in 400 dimensions, every eigenvector asked for: the
    MRRR solver's basis stays orthonormal to 1e-10 and spans the 50 non-zero directions."""
    B = torch.randn(400, 50, generator=_gen(3), dtype=torch.float64)
    G = B @ B.T
    V = top_eigenvectors_(G.clone(), 400)
    torch.testing.assert_close(V.T @ V, torch.eye(400, dtype=torch.float64), atol=1e-10,
                               rtol=0)
    Q = torch.linalg.qr(B)[0]
    assert subspace_overlap(V[:, :50], Q) == pytest.approx(1.0, abs=1e-9)


def test_top_eigenvectors_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match="k=0 must be in"):
        top_eigenvectors_(torch.eye(3, dtype=torch.float64), 0)
    with pytest.raises(ValueError, match="contiguous float64"):
        top_eigenvectors_(torch.eye(3), 1)
    with pytest.raises(ValueError, match="square"):
        top_eigenvectors_(torch.ones(3, 2, dtype=torch.float64), 1)
    bad = torch.eye(4, dtype=torch.float64)
    bad[1, 1] = float("inf")
    with pytest.raises(ValueError, match="infs or NaNs"):  # SciPy's check, not 0 vectors
        top_eigenvectors_(bad, 2)
