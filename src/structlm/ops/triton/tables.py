"""Device tables that drive the Triton kernels for any support (no per-algebra code).

For a support ``S[alpha, beta, delta]`` and group widths they list, per
``(support row, output group)``, the reduction groups to visit; per used weight block,
the types whose rows feed its gradient; and the static output-tile maps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from structlm.ops.plan import BlockPlan

__all__ = ["SupportTables", "build_tables"]


def _pad_lists(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(1, max((len(v) for v in lists), default=1))
    table = np.zeros((len(lists), width), dtype=np.int32)
    count = np.zeros(len(lists), dtype=np.int32)
    for i, v in enumerate(lists):
        table[i, : len(v)] = v
        count[i] = len(v)
    return table, count


@dataclass
class SupportTables:
    """All tables of one plan on one device (see :func:`build_tables`)."""

    q: int
    in_off: torch.Tensor  # (q+1,)
    out_off: torch.Tensor  # (q+1,)
    fwd_src: torch.Tensor  # (q, q, S): sources beta for (alpha, delta)
    fwd_cnt: torch.Tensor  # (q, q)
    bwd_dst: torch.Tensor  # (q, q, S): outputs delta for (alpha, beta)
    bwd_cnt: torch.Tensor  # (q, q)
    common_src: torch.Tensor  # (1, q, S): common blocks (two-stage stage 1)
    common_cnt: torch.Tensor
    extra_src: torch.Tensor  # (q, q, S): per-type blocks minus the common ones
    extra_cnt: torch.Tensor
    blk_beta: torch.Tensor  # (nb,) used blocks
    blk_delta: torch.Tensor
    blk_types: torch.Tensor  # (nb, T): types using the block
    blk_ntypes: torch.Tensor
    has_dead_blocks: bool
    max_sources: int
    key: tuple = ()
    """What the tables are built from (device, offsets, support): equal keys, equal tables."""

    def signature(self) -> tuple:
        """:attr:`key` (tables built by :func:`build_tables` always have one)."""
        if not self.key:
            raise ValueError("SupportTables without a key: build them with build_tables")
        return self.key

    def dw_tiles(self, block_n: int, block_k: int) -> torch.Tensor:
        """``(T, 3)``: (block id, first output row, first input column) of dW tiles."""
        key = ("dw", block_n, block_k)
        if key not in self._cache:
            io, oo = self.in_off.tolist(), self.out_off.tolist()
            rows = []
            for b, (be, de) in enumerate(zip(self.blk_beta.tolist(), self.blk_delta.tolist(),
                                             strict=True)):
                for n0 in range(oo[de], oo[de + 1], block_n):
                    for k0 in range(io[be], io[be + 1], block_k):
                        rows.append((b, n0, k0))
            arr = np.array(rows, dtype=np.int32).reshape(-1, 3)
            self._cache[key] = torch.as_tensor(arr, device=self.in_off.device)
        return self._cache[key]

    def __post_init__(self) -> None:
        self._cache: dict[tuple, torch.Tensor] = {}


def build_tables(plan: BlockPlan, mask: np.ndarray, device: torch.device) -> SupportTables:
    """Tables for the support ``mask (q, q, q)`` laid out by ``plan``, on ``device``."""
    q = plan.q
    common = mask.all(axis=0)
    fwd = [[list(np.flatnonzero(mask[a, :, d])) for d in range(q)] for a in range(q)]
    bwd = [[list(np.flatnonzero(mask[a, b, :])) for b in range(q)] for a in range(q)]
    com = [[list(np.flatnonzero(common[:, d])) for d in range(q)]]
    extra = [[list(np.flatnonzero(mask[a, :, d] & ~common[:, d])) for d in range(q)]
             for a in range(q)]
    width = max(1, max(len(v) for grid in (fwd, bwd, com, extra) for row in grid for v in row))

    def table(grid: list[list[list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        flat = [v for row in grid for v in row]
        t, c = _pad_lists([*flat, [0] * width])  # force the common width
        t, c = t[:-1], c[:-1]
        n = len(grid)
        return (torch.as_tensor(t.reshape(n, q, width), device=device),
                torch.as_tensor(c.reshape(n, q), device=device))

    used = mask.any(axis=0)
    blocks = [(b, d) for b in range(q) for d in range(q) if used[b, d]]
    users = [list(np.flatnonzero(mask[:, b, d])) for b, d in blocks]
    ut, uc = _pad_lists(users)
    fs, fc = table(fwd)
    bs, bc = table(bwd)
    cs, cc = table(com)
    es, ec = table(extra)
    as_t = lambda v: torch.as_tensor(np.asarray(v, dtype=np.int32), device=device)  # noqa: E731
    return SupportTables(
        q=q, in_off=as_t(plan.in_offsets), out_off=as_t(plan.out_offsets),
        fwd_src=fs, fwd_cnt=fc, bwd_dst=bs, bwd_cnt=bc, common_src=cs, common_cnt=cc,
        extra_src=es, extra_cnt=ec,
        blk_beta=as_t([b for b, _ in blocks]), blk_delta=as_t([d for _, d in blocks]),
        blk_types=torch.as_tensor(ut, device=device), blk_ntypes=torch.as_tensor(uc, device=device),
        has_dead_blocks=bool((~used).any()), max_sources=width,
        key=(str(torch.device(device)), tuple(plan.in_offsets), tuple(plan.out_offsets),
             mask.shape, np.ascontiguousarray(mask, dtype=bool).tobytes()),
    )
