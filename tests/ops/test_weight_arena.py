"""WeightArena: copies in placement order, one copy of shared memory, huge-page advice."""

from __future__ import annotations

import pytest
import torch

from structlm.ops.weight_arena import WeightArena, huge_pages_mode


def _place_all(arena: WeightArena, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [arena.place(t) for t in tensors]


def test_copies_equal_in_order_and_shared_memory_once() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(97, 7, generator=gen)
    b = torch.randn(1025, generator=gen, dtype=torch.float64)
    c = torch.randn(3, 5, generator=gen)
    tensors = [a, b, a.detach(), c]  # a's memory twice (as a tied weight is)
    arena = WeightArena()
    assert _place_all(arena, tensors)[0] is a  # counting: the tensors themselves
    arena.allocate()
    copies = _place_all(arena, tensors)
    for t, cp in zip(tensors, copies, strict=True):
        assert torch.equal(t, cp) and cp.dtype == t.dtype and cp.data_ptr() != t.data_ptr()
    assert copies[0].data_ptr() == copies[2].data_ptr()
    ptrs = [copies[i].data_ptr() for i in (0, 1, 3)]
    assert ptrs == sorted(ptrs) and all(p % 64 == 0 for p in ptrs)
    assert ptrs[0] % (2 << 20) == 0  # the buffer starts at a 2 MiB boundary
    assert arena.nbytes == sum((n + 63) // 64 * 64 for n in (97 * 7 * 4, 1025 * 8, 15 * 4))
    if huge_pages_mode() in ("always", "madvise"):
        assert arena.huge_pages


def test_misuse_is_refused() -> None:
    arena = WeightArena()
    arena.place(torch.ones(4))
    with pytest.raises(RuntimeError, match="allocate"):
        arena.counting = False
        arena.place(torch.ones(4))
    arena = WeightArena()
    arena.place(torch.ones(4))
    arena.allocate()
    with pytest.raises(RuntimeError, match="did not see"):
        arena.place(torch.ones(400))
    with pytest.raises(RuntimeError, match="twice"):
        arena.allocate()
