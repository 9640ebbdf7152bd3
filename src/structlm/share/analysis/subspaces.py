"""Tests 2 and 3 — do layers share a top-k subspace (of weights, or of function)?

For matrices ``W_l`` (one type, all layers) and a side (``input``: right singular
vectors, ``output``: left), with ``k`` directions — chosen per side by
:func:`per_side_k`: ``k_in = k_fraction·in`` on the input side and
``k_out = k_fraction·out`` on the output side (under grouped-query attention K and V are
192×576 in SmolLM2: ``k_out = 48``, ``k_in = 144``):

* **own** (ceiling): energy of ``W_l`` kept by its own top-k singular subspace (all of
  it when ``k`` exceeds the rank ``min(out, in)``, e.g. the output side of a tall
  MLP-in: then the own subspace is the whole column space, ``k_own = rank``);
* **shared** (candidate): energy kept by one basis for all layers, the top-k
  eigenvectors of ``sum_l W_l^T W_l`` (energy-weighted; fitted in-sample on all layers —
  the null control below goes through the same in-sample fit, so its score shows what
  that fit alone buys);
* **random** (floor): energy kept by a Haar-random k-dimensional subspace (expected
  value exactly k/dim for any matrix; one subspace is drawn per call and scores every
  layer — a draw per layer costs a QR of ``(dim, k)`` each, 240 of ``3072 × 768`` per
  MLP-in type, for nothing the expectation does not already say);
* **score** ``(shared − random) / (own − random)`` per layer, averaged;
* pairwise overlaps of the layers' own subspaces (mean squared cosine of the principal
  angles; chance = k_own/dim), for neighbouring layers and for all pairs.

Test 2 runs this on the weights; test 3 on ``M_l = W_l C_l^{1/2}`` (``C_l`` the input
second moment of layer ``l``; the analysis also runs it with the centred covariance and
with the attention-sink positions excluded), whose energy ``||M_l||^2 = E||W_l x||^2``
is the output energy on real inputs. Both report effective ranks (directions holding
90% of the energy) per layer.
"""

from __future__ import annotations

from typing import Any

import torch

from structlm.hf.linalg import (
    captured_energy,
    energy_weighted_basis,
    random_orthonormal,
    subspace_overlap,
    thin_svd,
)

__all__ = ["functional_matrices", "per_side_k", "subspace_scores"]


def per_side_k(shape: tuple[int, ...] | torch.Size, k_fraction: float) -> dict[str, int]:
    """``{"input": round(k_fraction·in), "output": round(k_fraction·out)}`` for a matrix
    of shape ``(out, in)``, each at least 1 and below its side's dimension."""
    out, inn = int(shape[0]), int(shape[1])
    if not 0 < k_fraction < 1:
        raise ValueError(f"k_fraction must be in (0, 1), got {k_fraction}")
    return {"input": min(inn - 1, max(1, round(k_fraction * inn))),
            "output": min(out - 1, max(1, round(k_fraction * out)))}


def functional_matrices(weights: list[torch.Tensor], roots: list[torch.Tensor]
                        ) -> list[torch.Tensor]:
    """``M_l = W_l C_l^{1/2}`` for each layer (``roots`` are the ``C_l^{1/2}``)."""
    return [W.double() @ S for W, S in zip(weights, roots, strict=True)]


def subspace_scores(mats: list[torch.Tensor], k: int, side: str, gen: torch.Generator,
                    energy: float = 0.9,
                    svds: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
                    rand_basis: torch.Tensor | None = None) -> dict[str, Any]:
    """Own / shared / random energies, scores, overlaps and effective ranks of ``mats``
    (one matrix per layer, all the same shape) on ``side`` with ``k`` directions.

    ``svds``: the thin SVDs ``(U, S, Vh)`` of ``mats`` when already computed;
    ``rand_basis``: the random ``(dim, k)`` basis when already drawn (else drawn from
    ``gen``)."""
    if len(mats) < 2:
        raise ValueError(f"need at least 2 layers to test sharing, got {len(mats)}")
    if side not in ("input", "output"):
        raise ValueError(f"side must be 'input' or 'output', got {side!r}")
    dim = mats[0].shape[1] if side == "input" else mats[0].shape[0]
    if not 0 < k < dim:
        raise ValueError(f"k must be in (0, {dim}) for side {side!r}, got {k}")
    if svds is None:
        svds = [thin_svd(W) for W in mats]
    shared = energy_weighted_basis(mats, k, side)
    k_own = min(k, min(mats[0].shape))  # the own subspace cannot exceed the rank
    own_bases = [U[:, :k_own] if side == "output" else Vh[:k_own].T for U, _, Vh in svds]
    own = [float(S[:k].pow(2).sum() / S.pow(2).sum()) for _, S, _ in svds]
    sh = [captured_energy(W, shared, side) for W in mats]
    if rand_basis is None:
        rand_basis = random_orthonormal(dim, k, gen)
    if tuple(rand_basis.shape) != (dim, k):
        raise ValueError(f"rand_basis has shape {tuple(rand_basis.shape)}, expected {(dim, k)}")
    rnd = [captured_energy(W, rand_basis, side) for W in mats]
    scores = [(s - r) / (o - r) if o - r > 1e-12 else float("nan")
              for s, r, o in zip(sh, rnd, own, strict=True)]
    n = len(mats)
    neighbour = [subspace_overlap(own_bases[i], own_bases[i + 1]) for i in range(n - 1)]
    pairs = [subspace_overlap(own_bases[i], own_bases[j])
             for i in range(n) for j in range(i + 1, n)]
    valid = [s for s in scores if s == s]
    return {
        "k": k, "k_own": k_own, "dim": dim, "side": side,
        "own": own, "shared": sh, "random": rnd, "score_per_layer": scores,
        "score": sum(valid) / len(valid) if valid else float("nan"),
        "overlap_neighbour": sum(neighbour) / len(neighbour),
        "overlap_all_pairs": sum(pairs) / len(pairs),
        "overlap_chance": k_own / dim,
        "effective_rank": [_effective_rank(S, energy) for _, S, _ in svds],
    }


def _effective_rank(S: torch.Tensor, energy: float) -> int:
    cum = torch.cumsum(S.pow(2), 0) / S.pow(2).sum()
    return int(torch.searchsorted(cum, torch.tensor(energy, dtype=cum.dtype)).item()) + 1
