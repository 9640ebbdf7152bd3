"""Ranks, stored parameters and budgets of the compression methods.

Every method's rank is bounded only by its own algebra, never by ``min(out, in)`` of a
method that does not need it (under grouped-query attention K and V are ``192 × 576`` in
SmolLM2; a shared input basis of V can hold up to 576 directions):

================== ============================================ ===========================
method             stored parameters of one type (``L`` layers)  rank bounds
================== ============================================ ===========================
``svd``            ``L k (out + in)`` per part                  ``k ≤ min(out_p, in)``
``shared``         ``k_out·out + k_in·in + L k_out k_in``       ``k_out ≤ out``, ``k_in ≤ in``
``hybrid``         ``shared + L r (out + in)``                  as ``shared``; ``r ≤ min``
``basis-sharing``  ``Σ_groups Σ_parts k_g·in + n_g k_g out_p``  ``k_g = min(k, in, n_g out_p)``
================== ============================================ ===========================

``basis-sharing`` (Wang et al., 2024) shares one input basis within each group of ``n_g``
consecutive layers. ``svd`` and ``basis-sharing`` factorise a gated MLP-in as two parts
(gate, up: ``parts = 2``, ``out_p = out / 2``), each on its own, as SVD-LLM and the Basis
Sharing code treat ``gate_proj`` and ``up_proj``; the seed's ``shared`` keeps the stacked
``[gate; up]`` as one matrix type. Basis sharing's private types (O, MLP-out by default)
are per-layer ``svd``. ``onesided-all-layers`` is ``basis-sharing`` with one group of all
layers.

Budgets are **per type**: ``target_reduction`` removes that fraction of every compressed
type's parameters (the convention of the Basis Sharing and SVD-LLM tables), so every
method stores the same number of parameters per type up to one rank's rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BASIS_SHARING", "METHODS", "TypeRanks", "consecutive_groups", "max_basis_rank",
           "solve_basis_sharing_rank", "solve_svd_rank", "stored_parameters", "token_macs"]

METHODS = ("shared", "hybrid", "svd", "basis-sharing", "onesided-all-layers")
"""Compression methods (``onesided-all-layers`` = ``basis-sharing`` with one group)."""

BASIS_SHARING = ("basis-sharing", "onesided-all-layers")


@dataclass(frozen=True)
class TypeRanks:
    """Ranks of one matrix type: ``k_out`` × ``k_in`` cores for ``shared``/``hybrid``;
    ``k_out = k_in = k`` for ``svd`` and the one-sided basis size; ``r`` the hybrid's
    per-layer residual rank."""

    k_out: int
    k_in: int
    r: int = 0

    @property
    def k(self) -> int:
        """The input-side rank (the one-sided basis size, the SVD rank)."""
        return self.k_in


def consecutive_groups(L: int, group_size: int) -> list[list[int]]:
    """Layers ``0..L-1`` in groups of ``group_size`` consecutive layers; a remainder forms
    a last, smaller group (as in the Basis Sharing code)."""
    if not 1 <= group_size:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    g = min(group_size, L)
    return [list(range(i, min(i + g, L))) for i in range(0, L, g)]


def max_basis_rank(inn: int, n: int, out_part: int) -> int:
    """Largest useful one-sided basis of a group of ``n`` layers: the rank of the stacked
    ``(n·out_part, in)`` matrix, ``min(in, n·out_part)``."""
    return min(inn, n * out_part)


def _layers_and_part_rows(group_sizes: list[int], out: int, parts: int) -> tuple[int, int]:
    """``L`` (layers over all groups) and ``out_p`` (rows of one part)."""
    if out % parts:
        raise ValueError(f"{out} rows do not split into {parts} equal parts")
    return sum(group_sizes), out // parts


def stored_parameters(method: str, out: int, inn: int, ranks: TypeRanks,
                      group_sizes: list[int], parts: int = 1) -> int:
    """Stored parameters of one type under ``method`` (biases unchanged, not counted).

    ``group_sizes``: layers per group (``[1] * L`` for per-layer methods; only
    ``basis-sharing`` reads the grouping); ``parts``: row blocks factorised separately
    (2 for a gated MLP-in under ``basis-sharing``)."""
    L, op = _layers_and_part_rows(group_sizes, out, parts)
    if method == "svd":
        return parts * L * ranks.k * (op + inn)
    if method in ("shared", "hybrid"):
        base = ranks.k_out * out + ranks.k_in * inn + L * ranks.k_out * ranks.k_in
        return base + (L * ranks.r * (out + inn) if method == "hybrid" else 0)
    if method in BASIS_SHARING:
        return parts * sum(min(ranks.k, max_basis_rank(inn, n, op)) * (inn + n * op)
                           for n in group_sizes)
    raise ValueError(f"unknown method {method!r}: expected one of {METHODS}")


def token_macs(method: str, out: int, inn: int, ranks: TypeRanks, group_sizes: list[int],
               parts: int = 1) -> int:
    """Multiply-adds per token of one type summed over its ``L`` layers, in the order the
    modules take for one row (``P x`` first; a shared basis's ``U A`` is not formed):

    ``svd`` ``parts·k (out_p + in)`` a layer (= its stored parameters); ``shared``
    ``k_in·in + k_out·k_in + out·k_out`` (``hybrid`` ``+ r (out + in)``); ``basis-sharing``
    ``parts·k_g (in + out_p)``, since every layer maps its own input onto the group's
    basis. Unlike the stored parameters, a shared basis costs MACs in every layer: a
    two-sided ``shared`` type can cost more per token than the dense matrix."""
    L, op = _layers_and_part_rows(group_sizes, out, parts)
    if method == "svd":
        return parts * L * ranks.k * (op + inn)
    if method in ("shared", "hybrid"):
        per = inn * ranks.k_in + ranks.k_in * ranks.k_out + ranks.k_out * out
        return L * (per + (ranks.r * (out + inn) if method == "hybrid" else 0))
    if method in BASIS_SHARING:
        return parts * sum(n * min(ranks.k, max_basis_rank(inn, n, op)) * (inn + op)
                           for n in group_sizes)
    raise ValueError(f"unknown method {method!r}: expected one of {METHODS}")


def solve_svd_rank(L: int, out: int, inn: int, budget: float, parts: int = 1) -> int:
    """Largest per-layer rank ``k ≤ min(out/parts, in)`` with
    ``parts · L k (out/parts + in) ≤ budget``."""
    op = out // parts
    k = int(budget // (parts * L * (op + inn)))
    if k < 1:
        raise ValueError(f"a budget of {budget:,.0f} parameters cannot hold rank 1 of "
                         f"{L} × ({out}, {inn}) per-layer factors")
    return min(k, op, inn)


def solve_basis_sharing_rank(out: int, inn: int, group_sizes: list[int], parts: int,
                             budget: float) -> int:
    """Largest basis size ``k`` whose ``basis-sharing`` storage fits ``budget`` (groups
    whose stacked matrix has fewer than ``k`` directions keep all of theirs)."""
    op = out // parts
    top = max(max_basis_rank(inn, n, op) for n in group_sizes)

    def stored(k: int) -> int:
        return stored_parameters("basis-sharing", out, inn, TypeRanks(k, k), group_sizes,
                                 parts)

    if stored(1) > budget:
        raise ValueError(f"a budget of {budget:,.0f} parameters cannot hold a rank-1 shared "
                         f"basis of ({out}, {inn}) in groups {group_sizes}")
    lo, hi = 1, top  # stored() is non-decreasing in k: bisection for the last k that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if stored(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
