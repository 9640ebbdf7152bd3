"""A block plan: the support of a layer laid out as GEMM work on column ranges.

For a support ``S[alpha, beta, delta]`` and group widths, the plan lists

* the *common* blocks (used by every type; the diagonal for every catalogue
  algebra), done once for all rows — as a single batched GEMM when they are the
  diagonal and the widths are equal;
* per type, the remaining blocks grouped by source group ``beta`` into runs of
  consecutive output groups ``[d0, d1)`` (one GEMM each over that type's rows).

Nothing in a plan multiplies a block outside the support, so the MACs of the
blocked backend equal the cost model exactly.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from structlm.algebra.support import LayerSupport

__all__ = ["BlockPlan", "Rect", "Run", "SharedRun", "make_plan"]

#: ``(beta, d0, d1)``: source group ``beta`` feeds output groups ``d0 .. d1 - 1``.
Run = tuple[int, int, int]
#: ``(beta, d0, d1, types)``: the same blocks, used by exactly the types ``types``.
SharedRun = tuple[int, int, int, tuple[int, ...]]
#: ``(d0, d1, b0, b1)``: output groups ``d0 .. d1 - 1`` read input groups ``b0 .. b1 - 1``.
Rect = tuple[int, int, int, int]


def _output_major_rects(blocks: np.ndarray) -> tuple[Rect, ...]:
    """Cover a ``(q, q)`` bool block mask over ``(beta, delta)`` by rectangles: per output
    group the contiguous runs of source groups, consecutive output groups with the same
    runs merged (few, large GEMMs for one type's rows; exactly the mask's blocks)."""
    q = blocks.shape[0]
    by_delta = _runs(blocks.T)  # (delta, b0, b1): per output group, runs of sources
    per = [tuple((b0, b1) for d, b0, b1 in by_delta if d == dd) for dd in range(q)]
    out: list[Rect] = []
    d = 0
    while d < q:
        d0 = d
        while d < q and per[d] == per[d0]:
            d += 1
        out.extend((d0, d, b0, b1) for b0, b1 in per[d0])
    return tuple(out)


def _shared_runs(mask: np.ndarray, common: np.ndarray) -> tuple[SharedRun, ...]:
    """Non-common blocks grouped by source and by the set of types using them."""
    q = mask.shape[0]
    out: list[SharedRun] = []
    for beta in range(q):
        d = 0
        while d < q:
            users = tuple(int(a) for a in np.flatnonzero(mask[:, beta, d]))
            if common[beta, d] or not users:
                d += 1
                continue
            d0 = d
            while d < q and not common[beta, d] and tuple(
                    int(a) for a in np.flatnonzero(mask[:, beta, d])) == users:
                d += 1
            out.append((beta, d0, d, users))
    return tuple(out)


def _runs(blocks: np.ndarray) -> tuple[Run, ...]:
    """Group a ``(q, q)`` bool block mask by source into runs of output groups."""
    out: list[Run] = []
    q = blocks.shape[0]
    for beta in range(q):
        d = 0
        while d < q:
            if blocks[beta, d]:
                d0 = d
                while d < q and blocks[beta, d]:
                    d += 1
                out.append((beta, d0, d))
            else:
                d += 1
    return tuple(out)


@dataclass(frozen=True)
class BlockPlan:
    """GEMM layout of a support for given widths (see module docstring)."""

    q: int
    in_offsets: tuple[int, ...]
    out_offsets: tuple[int, ...]
    common_is_diag: bool
    equal_widths: bool
    common_runs: tuple[Run, ...]
    type_runs: tuple[tuple[Run, ...], ...]
    shared_runs: tuple[SharedRun, ...]
    used_blocks: np.ndarray  # (q, q) bool over (beta, delta)

    @property
    def in_features(self) -> int:
        """Total input width ``K``."""
        return self.in_offsets[-1]

    @property
    def out_features(self) -> int:
        """Total output width ``N``."""
        return self.out_offsets[-1]

    @cached_property
    def common_covers_outputs(self) -> bool:
        """Every output group receives a common block (y needs no zero fill)."""
        return {d for _, d0, d1 in self.common_runs for d in range(d0, d1)} == set(range(self.q))

    @cached_property
    def common_covers_inputs(self) -> bool:
        """Every input group is the source of a common block (dX needs no zero fill)."""
        return {b for b, _, _ in self.common_runs} == set(range(self.q))

    @cached_property
    def has_shared_blocks(self) -> bool:
        """Some non-common block is used by more than one type (e.g. ``Q2^2``)."""
        return any(len(types) > 1 for *_, types in self.shared_runs)

    @cached_property
    def sorted_type_order(self) -> tuple[int, ...]:
        """The order of types in which rows are sorted for the block-major layout: the
        one that splits the type sets of :attr:`shared_runs` into the fewest contiguous
        row ranges (exhaustive up to ``q = 6``, e.g. ``(0, 1, 3, 2)`` for ``Q2^2``, whose
        four shared pairs form a cycle); beyond ``q = 6`` a deterministic descent over
        pairwise swaps from the identity (``Q2^3``: 3 s exhaustive, milliseconds so)."""
        q = self.q
        sets = [types for *_, types in self.shared_runs if len(types) > 1]
        if not sets:
            return tuple(range(q))

        def pieces(order: tuple[int, ...]) -> int:
            pos = {a: i for i, a in enumerate(order)}
            total = 0
            for types in sets:
                p = sorted(pos[a] for a in types)
                total += 1 + sum(1 for i in range(1, len(p)) if p[i] != p[i - 1] + 1)
            return total

        if q <= 6:
            return min(itertools.permutations(range(q)), key=pieces)
        order, best = tuple(range(q)), pieces(tuple(range(q)))
        improved = True
        while improved:
            improved = False
            for i, j in itertools.combinations(range(q), 2):
                cand = list(order)
                cand[i], cand[j] = cand[j], cand[i]
                if (n := pieces(tuple(cand))) < best:
                    order, best, improved = tuple(cand), n, True
        return order

    @cached_property
    def type_blocks(self) -> np.ndarray:
        """``(q, q, q)`` bool: ``[alpha, beta, delta]`` = type ``alpha`` uses block
        ``(beta, delta)`` (common blocks included)."""
        masks = np.zeros((self.q, self.q, self.q), dtype=bool)
        for beta, d0, d1 in self.common_runs:
            masks[:, beta, d0:d1] = True
        for alpha, runs in enumerate(self.type_runs):
            for beta, d0, d1 in runs:
                masks[alpha, beta, d0:d1] = True
        return masks

    @cached_property
    def type_rects(self) -> tuple[tuple[Rect, ...], ...]:
        """Per type, every block it uses (common ones included) as output-major
        rectangles (see :func:`_output_major_rects`)."""
        return tuple(_output_major_rects(m) for m in self.type_blocks)

    @cached_property
    def narrowest_input_group(self) -> int:
        """The fewest input columns of any group."""
        io = self.in_offsets
        return min(b - a for a, b in itertools.pairwise(io))

    @cached_property
    def diag_plus_row(self) -> bool:
        """The ``Q_q`` shape: type ``alpha`` adds exactly row ``alpha`` off the diagonal."""
        if not (self.common_is_diag and self.equal_widths):
            return False
        q = self.q
        for a, runs in enumerate(self.type_runs):
            want = tuple(r for r in ((a, 0, a), (a, a + 1, q)) if r[1] < r[2])
            if runs != want:
                return False
        return True


def make_plan(
    support: LayerSupport, in_widths: Sequence[int], out_widths: Sequence[int]
) -> BlockPlan:
    """Build the block plan of ``support`` for the given group widths."""
    q = support.q
    common = support.common_blocks
    type_runs = tuple(_runs(support.mask[a] & ~common) for a in range(q))
    s, r = list(in_widths), list(out_widths)
    return BlockPlan(
        q=q,
        in_offsets=tuple(int(v) for v in np.concatenate([[0], np.cumsum(s)])),
        out_offsets=tuple(int(v) for v in np.concatenate([[0], np.cumsum(r)])),
        common_is_diag=bool((common == np.eye(q, dtype=bool)).all()),
        equal_widths=len(set(s)) == 1 and len(set(r)) == 1,
        common_runs=_runs(common),
        type_runs=type_runs,
        shared_runs=_shared_runs(support.mask, common),
        used_blocks=support.used_blocks.copy(),
    )
