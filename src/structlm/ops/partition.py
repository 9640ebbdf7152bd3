"""Which rows of a flattened batch have which position type.

A :class:`TypePartition` is computed once from the types tensor (one host copy of
the types) and can be shared by every layer of a model forward.  For each type it
keeps either a ``slice`` (the rows form an arithmetic progression: contiguous runs
or a cyclic schedule — GEMMs then read and write *views*, nothing is copied) or an
index tensor (any other pattern: rows are gathered).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RowSet", "TypePartition", "TypeSortedRows", "check_types"]


@dataclass(frozen=True)
class RowSet:
    """Rows of one type: a slice when they are evenly spaced, else an index."""

    count: int
    rows: slice | None
    index: torch.Tensor | None  # (count,) int64 on the data device

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """Rows of a 2-D tensor ``(M, C) -> (count, C)``: a view for a slice."""
        if self.rows is not None:
            return t[self.rows]
        assert self.index is not None
        return t.index_select(0, self.index)


@dataclass(frozen=True, eq=False)
class TypeSortedRows:
    """Rows sorted by type in a chosen order (:meth:`TypePartition.type_sorted`)."""

    perm: torch.Tensor | None
    """``(M,)``: sorted row ``i`` is original row ``perm[i]`` (``None``: already sorted)."""
    inverse: torch.Tensor | None
    """``(M,)``: original row ``j`` is sorted row ``inverse[j]`` (``None`` likewise)."""
    starts: tuple[int, ...]
    """First sorted row of each type."""
    counts: tuple[int, ...]
    """Rows of each type."""

    def sort(self, t: torch.Tensor) -> torch.Tensor:
        """``(M, C)`` rows in sorted order (the tensor itself when already sorted)."""
        return t if self.perm is None else t.index_select(0, self.perm)

    def unsort(self, t: torch.Tensor) -> torch.Tensor:
        """Sorted ``(M, C)`` rows back in the original order."""
        return t if self.inverse is None else t.index_select(0, self.inverse)

    def ranges(self, types: tuple[int, ...]) -> list[tuple[int, int]]:
        """The rows of ``types`` as maximal contiguous ``[start, stop)`` ranges."""
        spans = sorted((self.starts[a], self.starts[a] + self.counts[a])
                       for a in types if self.counts[a])
        merged: list[tuple[int, int]] = []
        for a, b in spans:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        return merged


def check_types(types: torch.Tensor, q: int, leading_shape: torch.Size) -> torch.Tensor:
    """Validate a types tensor against ``x``'s leading shape; return it flattened."""
    if not isinstance(types, torch.Tensor):
        raise TypeError(f"position types must be a tensor, got {type(types).__name__}")
    if types.dtype.is_floating_point or types.dtype == torch.bool or types.is_complex():
        raise TypeError(f"position types must be an integer tensor, got {types.dtype}")
    if types.shape != leading_shape:
        if types.dim() == 1 and len(leading_shape) >= 1 and types.shape[0] == leading_shape[-1]:
            types = types.expand(leading_shape)  # one schedule row shared by the batch
        else:
            raise ValueError(
                f"position types have shape {tuple(types.shape)} but x has leading shape "
                f"{tuple(leading_shape)}; expected types of shape {tuple(leading_shape)} "
                f"(or ({leading_shape[-1] if len(leading_shape) else 1},) shared by the batch)"
            )
    return types.reshape(-1)


class TypePartition:
    """Row sets of every type for ``M`` flattened rows.

    Args:
        types: ``(M,)`` integer tensor with values in ``[0, q)``.
        q: number of types.
    """

    def __init__(self, types: torch.Tensor, q: int) -> None:
        flat = types.reshape(-1)
        host = flat.detach().to("cpu", torch.int64)
        self.q = q
        self.types = flat
        self.num_rows = int(host.numel())
        self.device = flat.device
        if self.num_rows:
            lo, hi = int(host.min()), int(host.max())
            if lo < 0 or hi >= q:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"position type {bad} is out of range: this layer has q={q} types, "
                    f"so types must lie in [0, {q - 1}]"
                )
        counts = torch.bincount(host, minlength=q)
        order = torch.argsort(host, stable=True)
        self.counts: list[int] = [int(c) for c in counts]
        self.sets: list[RowSet] = []
        start = 0
        for c in self.counts:
            seg = order[start : start + c]
            start += c
            self.sets.append(self._row_set(seg))
        self._sorted = order
        self._device_cache: dict[str, torch.Tensor] = {}
        self._sorted_rows: dict[str, TypeSortedRows] = {}

    def _row_set(self, seg: torch.Tensor) -> RowSet:
        c = int(seg.numel())
        if c == 0:
            return RowSet(0, slice(0, 0, 1), None)
        first = int(seg[0])
        if c == 1:
            return RowSet(1, slice(first, first + 1, 1), None)
        step = int(seg[1] - seg[0])
        if bool((seg[1:] - seg[:-1] == step).all()):
            return RowSet(c, slice(first, first + step * (c - 1) + 1, step), None)
        return RowSet(c, None, seg.to(self.device))

    @property
    def present(self) -> list[int]:
        """Types that have at least one row."""
        return [a for a, c in enumerate(self.counts) if c > 0]

    @property
    def balanced(self) -> bool:
        """Every type has the same, non-zero number of rows."""
        return self.counts[0] > 0 and all(c == self.counts[0] for c in self.counts)

    def rows_of(self, types: tuple[int, ...]) -> torch.Tensor:
        """Row indices (on the data device) of all rows whose type is in ``types``."""
        key = "rows" + ",".join(map(str, types))
        if key not in self._device_cache:
            parts = [self._row_indices(a) for a in types if self.counts[a]]
            idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
            self._device_cache[key] = idx.to(self.device)
        return self._device_cache[key]

    def type_sorted(self, order: tuple[int, ...]) -> TypeSortedRows:
        """The rows sorted by type in ``order`` (cached per order): each type's rows
        become one contiguous range, so any set of types is a few ranges of views."""
        key = "type_sorted" + ",".join(map(str, order))
        if key not in self._sorted_rows:
            if sorted(order) != list(range(self.q)):
                raise ValueError(f"order {order} is not a permutation of the {self.q} types")
            perm = torch.cat([self._row_indices(a) for a in order])
            identity = bool((perm == torch.arange(self.num_rows)).all())
            starts, s = [0] * self.q, 0
            for a in order:
                starts[a] = s
                s += self.counts[a]
            self._sorted_rows[key] = TypeSortedRows(
                None if identity else perm.to(self.device),
                None if identity else torch.argsort(perm).to(self.device),
                tuple(starts), tuple(self.counts))
        return self._sorted_rows[key]

    def _row_indices(self, a: int) -> torch.Tensor:
        rs = self.sets[a]
        if rs.count == 0:
            return torch.zeros(0, dtype=torch.long)
        if rs.index is not None:
            return rs.index.cpu()
        assert rs.rows is not None
        return torch.arange(rs.rows.start, rs.rows.stop, rs.rows.step)

    def sorted_index(self) -> torch.Tensor:
        """``(q, M/q)`` row indices grouped by type (balanced partitions only)."""
        if "sorted" not in self._device_cache:
            self._device_cache["sorted"] = self._sorted.view(self.q, -1).to(self.device)
        return self._device_cache["sorted"]

    def complement_index(self) -> torch.Tensor:
        """``(q, (q-1) M/q)``: for group ``d``, the rows whose type is not ``d``."""
        if "complement" not in self._device_cache:
            srt = self._sorted.view(self.q, -1)
            rows = [torch.cat([srt[a] for a in range(self.q) if a != d]) for d in range(self.q)]
            self._device_cache["complement"] = torch.stack(rows).to(self.device)
        return self._device_cache["complement"]

    def __repr__(self) -> str:
        kinds = ["-" if s.count == 0 else ("view" if s.rows is not None else "gather")
                 for s in self.sets]
        return f"TypePartition(M={self.num_rows}, counts={self.counts}, rows={kinds})"
