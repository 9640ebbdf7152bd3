"""Weights laid out for streaming: one buffer, in the order a decode step reads them,
backed by transparent huge pages where the kernel offers them.

Decode at batch 1 streams every weight once per token, so its speed is the memory
system's. Two things the default allocation leaves on the table, measured on this
project's 2-core VM (SmolLM2's 211 matrices + head, 538 MB, rotating GEMVs): 4 KiB pages
cost a TLB miss every 4 KiB of a stream, and 2 MiB pages read 8% faster (26.2 -> 28.3 GB/s
on 2 threads; ``benchmarks/results/`` has the decode runs). An :class:`WeightArena` is one
anonymous ``mmap`` advised ``MADV_HUGEPAGE`` before its pages are first touched (Linux
with THP in ``always`` or ``madvise`` mode; elsewhere a plain buffer), holding copies of
the weights placed in it back to back (each at a 64-byte boundary), in placement order.

It costs a second copy of every placed weight (the model's own parameters stay as they
are, for its forward and training).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

__all__ = ["WeightArena", "huge_pages_mode"]

_HUGE = 2 << 20
_ALIGN = 64
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_mode() -> str:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``) or
    ``unavailable``."""
    try:
        text = _THP.read_text()
    except OSError:
        return "unavailable"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unavailable"


class WeightArena:
    """Copies of tensors placed in one buffer (see the module docstring).

    Use in two passes with the same placements: :meth:`place` while ``counting`` returns
    the tensor itself and adds up the bytes; :meth:`allocate` then makes the buffer, and
    :meth:`place` returns each tensor's copy in it (a tensor placed twice — the same memory,
    shape and strides, e.g. a tied embedding — gets one copy).
    """

    def __init__(self) -> None:
        self.counting = True
        self.nbytes = 0
        self.huge_pages = False
        self._buffer: torch.Tensor | None = None
        self._mmap: mmap.mmap | None = None
        self._offset = 0
        #: (address, dtype, shape, strides) -> (the tensor, kept alive; its copy)
        self._seen: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def _padded(nbytes: int) -> int:
        return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor (counting) or its contiguous copy in the arena."""
        if t.device.type != "cpu":
            raise ValueError(f"a weight arena holds CPU tensors, got one on {t.device}")
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if key in self._seen:  # the same memory (a tied weight, a shared basis): one copy
            return self._seen[key][1]
        nbytes = t.numel() * t.element_size()
        if self.counting:
            self.nbytes += self._padded(nbytes)
            self._seen[key] = (t, t)
            return t
        if self._buffer is None:
            raise RuntimeError("WeightArena.place after counting: call allocate() first")
        if self._offset + nbytes > self._buffer.numel():
            raise RuntimeError("WeightArena: a placement the counting pass did not see")
        raw = self._buffer[self._offset:self._offset + nbytes]
        copy = raw.view(t.dtype).view(t.shape)
        copy.copy_(t.detach())
        self._offset += self._padded(nbytes)
        self._seen[key] = (t, copy)
        return copy

    def allocate(self) -> None:
        """Makes the buffer for what was counted; placements from now on are copies."""
        if not self.counting:
            raise RuntimeError("WeightArena.allocate called twice")
        self.counting = False
        self._seen.clear()
        size = self.nbytes + _HUGE  # room to start at a 2 MiB boundary
        self._mmap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages_mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
                self.huge_pages = True
            except OSError:
                self.huge_pages = False
        whole = torch.frombuffer(self._mmap, dtype=torch.uint8)
        start = (-whole.data_ptr()) % _HUGE
        self._buffer = whole[start:start + self.nbytes]
