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

__all__ = ["RowSet", "TypePartition", "check_types"]


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
            parts = []
            for a in types:
                rs = self.sets[a]
                if rs.count == 0:
                    continue
                if rs.index is not None:
                    parts.append(rs.index.cpu())
                else:
                    assert rs.rows is not None
                    parts.append(torch.arange(rs.rows.start, rs.rows.stop, rs.rows.step))
            idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
            self._device_cache[key] = idx.to(self.device)
        return self._device_cache[key]

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
