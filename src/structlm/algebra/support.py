"""The layer support ``S[alpha, beta, delta]`` derived from an algebra's cell layout.

A position of type ``alpha`` carries feature groups ``x_0 .. x_{q-1}``; its output
group ``delta`` is ``y_delta = sum_beta S[alpha, beta, delta] x_beta W_{beta, delta}``.

Derivation from the structure tensor (no per-algebra formulas): the token is row
``alpha`` of a ``q × q`` grid element ``X`` (cell ``(alpha, beta)`` holds ``x_beta``),
the weight is the grid element ``W`` (cell ``(beta, delta)`` holds ``W_{beta,delta}``),
and ``y_delta`` is cell ``(alpha, delta)`` of the algebra product ``X * W``.  Hence

* if cell ``(alpha, delta)`` exists: ``S[alpha, beta, delta] = 1`` iff the structure
  constant ``c[(alpha, beta), (beta, delta), (alpha, delta)]`` is non-zero;
* if the algebra has no cell ``(alpha, delta)`` (a general graph without the edge
  ``alpha -> delta``), the group falls back to the vertex algebra ``F e_delta``:
  ``y_delta = x_delta W_{delta, delta}`` (``S[alpha, delta, delta] = 1`` only).

For ``Q_q`` this gives ``beta in {alpha, delta}``; for tensor powers the bitwise rule
``beta_k in {alpha_k, delta_k}``; for a general graph "``beta == delta``, or
``beta == alpha`` and ``alpha -> delta`` is an edge".  In a general graph the blocks
``W_{beta, delta}`` with ``beta != delta`` and no edge ``beta -> delta`` are used by no
type: they stay in the weight (so state dicts match ``nn.Linear``) but are dead:
never read, never given a gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

import numpy as np

from structlm.algebra.structure import Algebra, AlgebraError

__all__ = ["LayerSupport", "split_widths", "support_of"]


def split_widths(total: int, q: int, what: str = "features") -> tuple[int, ...]:
    """Equal widths ``total / q``; raise a clear error when ``q`` does not divide."""
    if total % q:
        raise AlgebraError(
            f"{what}={total} is not divisible by q={q}: equal group widths need "
            f"{what} % q == 0 (nearest multiples: {total - total % q}, "
            f"{total - total % q + q}); pass explicit group_sizes for unequal widths"
        )
    return (total // q,) * q


@dataclass(frozen=True, eq=False)
class LayerSupport:
    """Boolean support ``mask[alpha, beta, delta]`` of a position-typed layer."""

    name: str
    mask: np.ndarray  # (q, q, q) bool
    grid_coefficients: np.ndarray  # (q, q, q): c[(a,b),(b,d),(a,d)], 0 where absent
    complete_grid: bool = True  # every cell (a, d) is a basis element (no fallback)

    @property
    def q(self) -> int:
        """Number of types = number of feature groups."""
        return int(self.mask.shape[0])

    @property
    def num_triples(self) -> int:
        """Number of ``(alpha, beta, delta)`` triples in the support."""
        return int(self.mask.sum())

    @cached_property
    def common_blocks(self) -> np.ndarray:
        """``(q, q)`` bool: blocks ``(beta, delta)`` used by every type."""
        return self.mask.all(axis=0)

    @cached_property
    def used_blocks(self) -> np.ndarray:
        """``(q, q)`` bool: blocks ``(beta, delta)`` used by at least one type."""
        return self.mask.any(axis=0)

    def weight_elements(self, present: Sequence[int], in_widths: Sequence[int],
                        out_widths: Sequence[int]) -> int:
        """Weight elements a call whose rows have the types ``present`` must read: the
        union of the blocks those types use (all of them once every type occurs)."""
        s = np.asarray(in_widths, dtype=np.int64)
        r = np.asarray(out_widths, dtype=np.int64)
        self._check_widths(s, r)
        bad = [a for a in present if not 0 <= int(a) < self.q]
        if bad:
            raise AlgebraError(f"types {bad} out of range for q={self.q}")
        if len(present) == 0:
            return 0
        union = self.mask[np.asarray(list(present), dtype=np.int64)].any(axis=0)
        return int((union * np.outer(s, r)).sum())

    def row_macs(self, in_widths: Sequence[int], out_widths: Sequence[int]) -> list[int]:
        """MACs of one row of each type: ``C_alpha = sum S s_beta r_delta``."""
        s = np.asarray(in_widths, dtype=np.int64)
        r = np.asarray(out_widths, dtype=np.int64)
        self._check_widths(s, r)
        blocks = np.outer(s, r)
        return [int((self.mask[a] * blocks).sum()) for a in range(self.q)]

    def macs(
        self, type_counts: Sequence[int], in_widths: Sequence[int], out_widths: Sequence[int]
    ) -> int:
        """Exact forward MACs for ``type_counts[alpha]`` rows of each type."""
        if len(type_counts) != self.q:
            raise AlgebraError(f"need {self.q} type counts, got {len(type_counts)}")
        per_row = self.row_macs(in_widths, out_widths)
        return int(sum(int(m) * c for m, c in zip(type_counts, per_row, strict=False)))

    def mac_ratio(
        self,
        in_widths: Sequence[int] | None = None,
        out_widths: Sequence[int] | None = None,
        type_counts: Sequence[int] | None = None,
    ) -> Fraction:
        """``rho``: MACs relative to dense ``M K N`` (equal widths and a uniform type
        mix by default), as an exact fraction."""
        s = list(in_widths) if in_widths is not None else [1] * self.q
        r = list(out_widths) if out_widths is not None else [1] * self.q
        counts = list(type_counts) if type_counts is not None else [1] * self.q
        total = sum(counts)
        if total <= 0:
            raise AlgebraError("type_counts must contain at least one row")
        return Fraction(self.macs(counts, s, r), total * sum(s) * sum(r))

    def _check_widths(self, s: np.ndarray, r: np.ndarray) -> None:
        if s.shape != (self.q,) or r.shape != (self.q,):
            raise AlgebraError(
                f"need {self.q} input and {self.q} output widths, got {s.size} and {r.size}"
            )
        if (s < 1).any() or (r < 1).any():
            raise AlgebraError(f"group widths must be positive, got {list(s)} / {list(r)}")


def support_of(algebra: Algebra) -> LayerSupport:
    """Derive the layer support of an algebra with a cell layout (see module doc)."""
    algebra.check_layer_ready()
    q = algebra.q
    assert q is not None and algebra.cells is not None
    cells = algebra.cells
    e = algebra.entries
    ri, ci = cells[e[:, 0], 0], cells[e[:, 0], 1]
    rj, cj = cells[e[:, 1], 0], cells[e[:, 1], 1]
    rk, ck = cells[e[:, 2], 0], cells[e[:, 2], 1]
    # matrix-unit shaped constants: (a, b) * (b, d) -> (a, d)
    ok = (ci == rj) & (ri == rk) & (cj == ck)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        i, j, k = (algebra.basis_names[int(t)] for t in e[bad])
        raise AlgebraError(
            f"algebra {algebra.name!r}: constant c[{i}, {j}, {k}] is not of the "
            "matrix-unit shape (a,b)*(b,d)->(a,d); a layer cannot be read off its cells"
        )
    coef = np.zeros((q, q, q))
    coef[ri, ci, cj] = algebra.values
    mask = coef != 0
    present = np.zeros((q, q), dtype=bool)
    present[cells[:, 0], cells[:, 1]] = True
    diag_self = mask[np.arange(q), np.arange(q), np.arange(q)]
    for a in range(q):
        for d in range(q):
            if not present[a, d]:
                mask[a, :, d] = False
                mask[a, d, d] = bool(diag_self[d])
    if not mask.any(axis=1).all():
        raise AlgebraError(f"algebra {algebra.name!r}: some output group receives no block")
    return LayerSupport(algebra.name, mask, coef, bool(present.all()))
