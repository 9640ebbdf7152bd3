"""Position-type schedules: absolute positions -> types in ``[0, q)``.

Types depend on *absolute* positions only, so training, prefill (whole or
chunked) and cached decoding see the same type for the same position.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["BlockSchedule", "CrossLayerSchedule", "CyclicSchedule", "TableSchedule",
           "TypeSchedule", "auto_schedule",
           "check_type_coverage", "get_schedule", "type_counts"]


class TypeSchedule(abc.ABC):
    """Base class: ``schedule(positions) -> types`` (same shape, int64)."""

    q: int

    #: whether :meth:`at_layer` gives different types in different layers
    depends_on_layer = False

    def at_layer(self, layer: int) -> TypeSchedule:
        """The schedule of decoder layer ``layer`` (the same in every layer by default)."""
        return self

    def __post_init__(self) -> None:
        if isinstance(self.q, bool) or not isinstance(self.q, int) or self.q < 1:
            raise ValueError(f"a schedule needs q >= 1 types, got q={self.q!r}")

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        if positions.dtype.is_floating_point:
            raise TypeError(f"positions must be integers, got {positions.dtype}")
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError(f"positions must be >= 0, got min {int(positions.min())}")
        return self._types(positions.long())

    @abc.abstractmethod
    def _types(self, positions: torch.Tensor) -> torch.Tensor:
        """Types of validated, int64 ``positions``."""


@dataclass(frozen=True)
class CyclicSchedule(TypeSchedule):
    """``tau(p) = p mod q`` (the kernel micro-benchmarks' schedule)."""

    q: int

    def _types(self, positions: torch.Tensor) -> torch.Tensor:
        return positions % self.q


@dataclass(frozen=True)
class BlockSchedule(TypeSchedule):
    """``tau(p) = floor((p mod period) / block)``: runs of ``block`` positions.

    ``period`` defaults to ``q * block`` (every type once per period). The paper's LM
    used ``q = 4``, ``block = 192``, period 768.
    """

    q: int
    block: int = 192
    period: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block < 1:
            raise ValueError(f"block size must be >= 1, got {self.block}")
        if self.period is None:
            object.__setattr__(self, "period", self.q * self.block)
        assert self.period is not None
        if self.period % self.block or not 0 < self.period // self.block <= self.q:
            raise ValueError(
                f"period {self.period} must be a multiple of block {self.block} with at "
                f"most q={self.q} blocks (so types stay in [0, {self.q}))"
            )

    def _types(self, positions: torch.Tensor) -> torch.Tensor:
        assert self.period is not None
        return (positions % self.period) // self.block


@dataclass(frozen=True)
class TableSchedule(TypeSchedule):
    """Custom schedule: ``tau(p) = table[p mod len(table)]``."""

    q: int
    table: tuple[int, ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.table:
            raise ValueError("a table schedule needs at least one entry")
        bad = [t for t in self.table if not 0 <= t < self.q]
        if bad:
            raise ValueError(f"table entries {bad} are outside [0, {self.q})")

    def _types(self, positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(self.table, dtype=torch.long, device=positions.device)
        return table[positions % len(self.table)]


@dataclass(frozen=True)
class CrossLayerSchedule(TypeSchedule):
    """A cross-layer schedule: ``tau_l(p) = (base(p) + l) mod q`` in decoder layer ``l``.

    Within a layer the types stay as balanced as ``base``'s; across ``q`` consecutive
    layers every position takes every type, so each token's representation passes
    through every type's off-diagonal blocks (with ``base`` alone a position keeps one
    type in every layer). As a plain schedule it is layer ``layer``'s (0 by default)."""

    q: int
    base: TypeSchedule
    layer: int = 0
    depends_on_layer = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.base.q != self.q:
            raise ValueError(f"base schedule has q={self.base.q}, expected {self.q}")
        if self.base.depends_on_layer:
            raise ValueError("the base of a cross-layer schedule must not depend on the layer")

    def at_layer(self, layer: int) -> CrossLayerSchedule:
        return CrossLayerSchedule(self.q, self.base, layer % self.q)

    def _types(self, positions: torch.Tensor) -> torch.Tensor:
        return (self.base(positions) + self.layer) % self.q


def get_schedule(spec: str | TypeSchedule | Sequence[int], q: int) -> TypeSchedule:
    """Schedule from a name: ``cyclic``, ``block`` (= ``block:192``, the paper's),
    ``block:<size>``, ``block:<size>:<period>``, ``table:<t0>,<t1>,...``, or
    ``cross-layer:<any of these>`` (:class:`CrossLayerSchedule`); or a sequence of
    types (a table)."""
    if isinstance(spec, TypeSchedule):
        if spec.q != q:
            raise ValueError(f"schedule has q={spec.q} but the layer has q={q}")
        return spec
    if not isinstance(spec, str):
        return TableSchedule(q, tuple(int(t) for t in spec))
    text = spec.strip().lower()
    if text == "auto":
        raise ValueError("type schedule 'auto' depends on the training context: resolve it "
                         "with auto_schedule(q, seq_len) first")
    if text.startswith("cross-layer:"):
        return CrossLayerSchedule(q, get_schedule(text.split(":", 1)[1], q))
    if text == "cyclic":
        return CyclicSchedule(q)
    if text in ("block", "paper"):
        return BlockSchedule(q, 192)
    if text.startswith("block:"):
        parts = text.split(":")[1:]
        period = int(parts[1]) if len(parts) > 1 else None
        return BlockSchedule(q, int(parts[0]), period)
    if text.startswith("table:"):
        return TableSchedule(q, tuple(int(t) for t in text.split(":", 1)[1].split(",")))
    raise ValueError(
        f"unknown schedule {spec!r}: expected 'cyclic', 'block', 'block:<size>[:<period>]', "
        "'table:<t0>,<t1>,...' or 'cross-layer:<one of these>'"
    )


def auto_schedule(q: int, seq_len: int) -> str:
    """The paper's block schedule scaled to a training context: blocks of
    ``seq_len / (2q)`` positions, as the paper's 192 = 1536 / (2 * 4), so that every
    training window holds every type, twice (``block:<size>``)."""
    if seq_len < q:
        raise ValueError(f"seq_len={seq_len} is shorter than q={q}: no schedule can give "
                         f"every one of the {q} types a position in a window")
    return f"block:{max(1, seq_len // (2 * q))}"


def type_counts(schedule: TypeSchedule, seq_len: int) -> list[int]:
    """Positions of each type in a window of absolute positions ``0 .. seq_len - 1`` (a
    training window): ``counts[t]`` for ``t`` in ``[0, q)``."""
    types = schedule(torch.arange(seq_len))
    return [int(c) for c in torch.bincount(types, minlength=schedule.q)]


def check_type_coverage(schedule: TypeSchedule, seq_len: int, spec: str = "") -> list[int]:
    """:func:`type_counts`, raising when a type gets no position: its off-diagonal blocks
    would never see a gradient, and generation at its positions would use untrained
    weights."""
    counts = type_counts(schedule, seq_len)
    missing = [t for t, c in enumerate(counts) if c == 0]
    if missing:
        raise ValueError(
            f"type schedule {spec or schedule!r} with q={schedule.q} gives types {missing} no "
            f"position in a training window of seq_len={seq_len} (positions per type: "
            f"{counts}); their weight blocks would never be trained. Use type_schedule "
            f"'auto' (= {auto_schedule(schedule.q, seq_len)!r} here) or 'cyclic', a longer "
            "seq_len, or set allow_untrained_types: true to train anyway")
    return counts
