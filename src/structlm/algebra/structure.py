"""Finite-dimensional algebras given by a (sparse) structure tensor.

An algebra with basis ``b_0 .. b_{n-1}`` is fixed by constants ``c[i, j, k]``:
``[mu(x, w)]_k = sum_{i,j} c[i, j, k] x_i w_j``.  The tensor is stored sparsely
(``entries`` of shape ``(nnz, 3)`` and ``values`` of shape ``(nnz,)``) because
``Q_q`` has dimension ``q^2`` and only ``2 q^2 - q`` non-zero constants.

Every fact reported here (associativity, unit, radical, number of maximal
two-sided ideals, rank bounds) is *computed from the tensor*, never asserted from
the closed-form formulas; tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

import numpy as np

__all__ = ["Algebra", "AlgebraError", "RankFacts"]

# Largest dimension for which the dense radical / quotient computations run.
_MAX_DENSE_QUOTIENT = 256
_TOL = 1e-9


class AlgebraError(ValueError):
    """Raised for an ill-formed algebra or an algebra unfit for the requested use."""


@dataclass(frozen=True)
class RankFacts:
    """Bilinear-rank facts of an algebra.

    Attributes:
        lower_bound: Alder–Strassen bound ``2 dim - t`` (``None`` if ``t`` unknown).
        explicit_products: scalar products of the explicit (schoolbook) algorithm:
            the number of pairs ``(i, j)`` with a non-zero slice ``c[i, j, :]``.
        exact: the rank when the two bounds meet, else ``None``.
    """

    lower_bound: int | None
    explicit_products: int
    exact: int | None

    @property
    def interval(self) -> tuple[int | None, int]:
        """``(lower, upper)`` bounds on the bilinear rank."""
        return (self.lower_bound, self.explicit_products)


class Algebra:
    """An algebra fixed by its structure tensor, with optional q×q cell layout.

    Args:
        name: display name (e.g. ``"Q4"``).
        dim: number of basis elements.
        entries: int array ``(nnz, 3)`` of ``(i, j, k)`` with ``c[i, j, k] != 0``.
        values: float array ``(nnz,)`` of the constants.
        basis_names: one name per basis element.
        cells: optional ``(dim, 2)`` int array placing basis element ``b`` at cell
            ``(row, col)`` of a ``q × q`` grid; needed to build a layer from it.
        q: side of the grid (required with ``cells``).
    """

    def __init__(
        self,
        name: str,
        dim: int,
        entries: np.ndarray,
        values: np.ndarray,
        basis_names: list[str] | None = None,
        cells: np.ndarray | None = None,
        q: int | None = None,
    ) -> None:
        entries = np.asarray(entries, dtype=np.int64).reshape(-1, 3)
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        if dim < 1:
            raise AlgebraError(f"algebra dimension must be >= 1, got {dim}")
        if entries.shape[0] != values.shape[0]:
            raise AlgebraError(
                f"entries has {entries.shape[0]} rows but values has {values.shape[0]}"
            )
        if entries.size and (entries.min() < 0 or entries.max() >= dim):
            raise AlgebraError(f"structure-tensor index out of range [0, {dim})")
        keep = np.abs(values) > 0
        entries, values = entries[keep], values[keep]
        # merge duplicate (i, j, k) by summing
        if entries.shape[0]:
            key = (entries[:, 0] * dim + entries[:, 1]) * dim + entries[:, 2]
            uniq, inv = np.unique(key, return_inverse=True)
            summed = np.zeros(uniq.shape[0])
            np.add.at(summed, inv, values)
            nz = np.abs(summed) > 0
            uniq, summed = uniq[nz], summed[nz]
            entries = np.stack([uniq // (dim * dim), (uniq // dim) % dim, uniq % dim], 1)
            values = summed
        self.name = name
        self.dim = int(dim)
        self.entries = entries
        self.values = values
        self.basis_names = basis_names or [f"b{i}" for i in range(dim)]
        if len(self.basis_names) != dim:
            raise AlgebraError(f"{len(self.basis_names)} basis names for dimension {dim}")
        if cells is not None:
            cells = np.asarray(cells, dtype=np.int64).reshape(-1, 2)
            if q is None or cells.shape[0] != dim:
                raise AlgebraError("cells needs q and one (row, col) per basis element")
            if cells.min() < 0 or cells.max() >= q:
                raise AlgebraError(f"cell coordinates must lie in [0, {q})")
            if len({(int(a), int(b)) for a, b in cells}) != dim:
                raise AlgebraError("two basis elements share one cell")
        self.cells = cells
        self.q = q

    # ------------------------------------------------------------------ basics
    def __repr__(self) -> str:
        return f"Algebra({self.name!r}, dim={self.dim}, nnz={self.nnz})"

    @property
    def nnz(self) -> int:
        """Number of non-zero structure constants."""
        return int(self.entries.shape[0])

    def multiply(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """``mu(x, w)`` for coordinate vectors ``x, w`` of shape ``(dim,)``."""
        x = np.asarray(x, dtype=np.float64)
        w = np.asarray(w, dtype=np.float64)
        out = np.zeros(self.dim, dtype=np.result_type(x, w))
        i, j, k = self.entries.T
        np.add.at(out, k, self.values * x[i] * w[j])
        return out

    # ----------------------------------------------------------- associativity
    def _triple_products(self, left: bool) -> dict[tuple[int, ...], float]:
        """Coefficient of ``b_l`` in ``(b_i b_j) b_k`` (left) or ``b_i (b_j b_k)``."""
        e, v = self.entries, self.values
        if left:  # (b_i b_j) = sum_m c[i,j,m] b_m ; b_m b_k = sum_l c[m,k,l] b_l
            join_a, join_b = e[:, 2], e[:, 0]
        else:  # (b_j b_k) = sum_m c[j,k,m] b_m ; b_i b_m = sum_l c[i,m,l] b_l
            join_a, join_b = e[:, 2], e[:, 1]
        order = np.argsort(join_b, kind="stable")
        sorted_b = join_b[order]
        starts = np.searchsorted(sorted_b, join_a, side="left")
        stops = np.searchsorted(sorted_b, join_a, side="right")
        counts = stops - starts
        if counts.sum() == 0:
            return {}
        a_idx = np.repeat(np.arange(e.shape[0]), counts)
        offs = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        b_idx = order[np.repeat(starts, counts) + offs]
        ea, eb = e[a_idx], e[b_idx]
        val = v[a_idx] * v[b_idx]
        if left:  # ea = (i, j, m), eb = (m, k, l)
            i, j, k, l_ = ea[:, 0], ea[:, 1], eb[:, 1], eb[:, 2]
        else:  # ea = (j, k, m), eb = (i, m, l)
            i, j, k, l_ = eb[:, 0], ea[:, 0], ea[:, 1], eb[:, 2]
        keys = np.stack([i, j, k, l_], 1)  # no packed integer key: d^4 overflows int64
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        summed = np.zeros(uniq.shape[0])
        np.add.at(summed, inv.reshape(-1), val)
        keep = np.abs(summed) > _TOL
        return {tuple(int(v) for v in kk): float(s)
                for kk, s in zip(uniq[keep], summed[keep], strict=True)}

    @cached_property
    def associativity_defect(self) -> float:
        """Largest ``|((b_i b_j) b_k - b_i (b_j b_k))_l|`` over all basis triples."""
        left = self._triple_products(left=True)
        right = self._triple_products(left=False)
        worst = 0.0
        for key in left.keys() | right.keys():
            worst = max(worst, abs(left.get(key, 0.0) - right.get(key, 0.0)))
        return worst

    @property
    def is_associative(self) -> bool:
        """True when ``(xy)z = x(yz)`` on every basis triple."""
        return self.associativity_defect <= _TOL

    # -------------------------------------------------------------------- unit
    @cached_property
    def unit(self) -> np.ndarray | None:
        """The two-sided unit ``1_A`` as coordinates, or ``None`` if there is none.

        Solves ``sum_i u_i c[i, j, k] = delta_jk`` and ``sum_j u_j c[i, j, k] =
        delta_ik`` in least squares, snaps to small rationals and verifies.
        """
        from scipy.sparse import coo_matrix
        from scipy.sparse.linalg import lsqr

        d = self.dim
        i, j, k = self.entries.T
        # equations (j, k) of the left unit and (i, k) of the right unit; only rows with
        # a coefficient or a non-zero right-hand side (the diagonal ones) matter
        rows = np.concatenate([j * d + k, d * d + i * d + k])
        diag = np.arange(d) * (d + 1)
        diag_rows = np.concatenate([diag, d * d + diag])
        if not np.isin(diag_rows, rows).all():
            return None  # some delta_jj = 1 equation has no term at all
        used = np.unique(np.concatenate([rows, diag_rows]))
        cols = np.concatenate([i, j])
        vals = np.concatenate([self.values, self.values])
        a = coo_matrix((vals, (np.searchsorted(used, rows), cols)),
                       shape=(used.shape[0], d)).tocsr()
        b = np.zeros(used.shape[0])
        b[np.searchsorted(used, diag_rows)] = 1.0
        u = lsqr(a, b, atol=1e-14, btol=1e-14, iter_lim=20 * d + 100)[0]
        snapped = np.array([float(Fraction(x).limit_denominator(1000)) for x in u])
        for cand in (snapped, u):
            if np.max(np.abs(a @ cand - b)) <= 1e-8:
                return cand
        return None

    @property
    def has_unit(self) -> bool:
        """True when a two-sided unit exists."""
        return self.unit is not None

    # ----------------------------------------------------- radical and ideals
    @cached_property
    def _trace_form(self) -> np.ndarray:
        """``T[a, b] = Tr(L_{b_a b_b})`` restricted to its active index set."""
        i, j, k = self.entries.T
        tau = np.zeros(self.dim)
        diag = j == k
        np.add.at(tau, i[diag], self.values[diag])  # Tr(L_{b_m}) = sum_j c[m, j, j]
        contrib = self.values * tau[k]
        mask = np.abs(contrib) > 0
        return np.stack([i[mask], j[mask]], 1), contrib[mask]

    @cached_property
    def radical_dim(self) -> int | None:
        """Dimension of the Jacobson radical ``J`` (characteristic 0: the kernel of
        the trace form ``(a, b) -> Tr(L_{ab})``); ``None`` when too large to compute."""
        q_basis = self._quotient_basis
        return None if q_basis is None else self.dim - q_basis[1].shape[1]

    @cached_property
    def _quotient_basis(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(active indices, orthonormal complement of J inside them)."""
        idx, vals = self._trace_form
        active = np.unique(idx.ravel()) if idx.size else np.zeros(0, dtype=np.int64)
        if active.shape[0] > _MAX_DENSE_QUOTIENT:
            return None
        pos = {int(a): n for n, a in enumerate(active)}
        t = np.zeros((active.shape[0], active.shape[0]))
        for (a, b), v in zip(idx, vals, strict=False):
            t[pos[int(a)], pos[int(b)]] += v
        if active.shape[0] == 0:
            return active, np.zeros((0, 0))
        u, s, _ = np.linalg.svd(t)
        rank = int(np.sum(s > _TOL * max(1.0, s.max())))
        return active, u[:, :rank]

    @cached_property
    def quotient_structure(self) -> np.ndarray | None:
        """Dense structure tensor of the semisimple quotient ``A / J``."""
        qb = self._quotient_basis
        if qb is None:
            return None
        active, basis = qb
        n = active.shape[0]
        pos = np.full(self.dim, -1)
        pos[active] = np.arange(n)
        i, j, k = (pos[c] for c in self.entries.T)
        inside = (i >= 0) & (j >= 0) & (k >= 0)  # the complement of J lives on `active`
        c_act = np.zeros((n, n, n))
        np.add.at(c_act, (i[inside], j[inside], k[inside]), self.values[inside])
        out = np.tensordot(basis, c_act, axes=(0, 0))  # (a, j, k)
        out = np.tensordot(out, basis, axes=(1, 0))  # (a, k, b)
        return np.tensordot(out, basis, axes=(1, 0)).transpose(0, 2, 1)  # (a, b, c)

    @cached_property
    def num_maximal_ideals(self) -> int | None:
        """``t``: number of maximal two-sided ideals = simple components of ``A/J``.

        Computed when ``A/J`` is commutative (a product of copies of R and C: the
        eigenvalues of a generic multiplication operator count them); ``None``
        ("unknown") otherwise.
        """
        cq = self.quotient_structure
        if cq is None:
            return None
        s = cq.shape[0]
        if s == 0:
            return 0
        if not np.allclose(cq, cq.transpose(1, 0, 2), atol=1e-8):
            return None
        x = np.random.default_rng(0).standard_normal(s)
        lx = np.einsum("a,abk->kb", x, cq)  # matrix of w -> x * w
        eig = np.linalg.eigvals(lx)
        real = int(np.sum(np.abs(eig.imag) <= 1e-8 * max(1.0, np.abs(eig).max())))
        return real + (s - real) // 2

    # -------------------------------------------------------------------- rank
    @cached_property
    def explicit_products(self) -> int:
        """Products of the explicit algorithm: pairs ``(i, j)`` with ``c[i,j,:] != 0``."""
        pairs = self.entries[:, 0] * self.dim + self.entries[:, 1]
        return int(np.unique(pairs).shape[0])

    @cached_property
    def rank(self) -> RankFacts:
        """Alder–Strassen bound, explicit product count and exact rank if they meet."""
        t = self.num_maximal_ideals
        lower = None if t is None else 2 * self.dim - t
        exact = self.explicit_products if lower == self.explicit_products else None
        return RankFacts(lower, self.explicit_products, exact)

    # ---------------------------------------------------------------- checking
    def check_layer_ready(self) -> None:
        """Raise :class:`AlgebraError` unless the algebra can define a layer."""
        if not self.is_associative:
            raise AlgebraError(
                f"algebra {self.name!r} is not associative (largest defect "
                f"{self.associativity_defect:.3g} on a basis triple); a layer needs "
                "an associative algebra so that composed layers stay in the family"
            )
        if not self.has_unit:
            raise AlgebraError(
                f"algebra {self.name!r} has no two-sided unit; a layer needs one so "
                "that no weight slot is dead in the full algebra"
            )
        if self.cells is None or self.q is None:
            raise AlgebraError(
                f"algebra {self.name!r} has no q×q cell layout; give `cells` and `q` "
                "so that positions types and feature groups can be read off it"
            )
