"""What every compression method shares: ranks and factors of one matrix type across
layers, the whitening roots, the kept-energy measure and the split into row blocks.

Notation: ``W_l`` ``(out, in)``, ``C_l`` its input second moment, ``L`` layers; every
product is float64. The methods themselves (``shared``/``hybrid``, ``svd``,
``basis-sharing``) live in :mod:`structlm.share.compress.methods`, one file each.

The per-layer ``energy`` is the functional energy kept under the layer's own input
statistics, ``1 − ||(W − Ŵ) S_l||² / ||W S_l||²``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from structlm.hf.linalg import psd_roots

__all__ = ["RootCache", "TypeFactors", "TypeRanks", "kept_energy", "meta_tensor", "part_rows",
           "split_bias"]


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


class RootCache:
    """``C^{1/2}`` and ``C^{-1/2}`` of input second moments, one ``eigh`` each, reused by
    every type that reads the same matrix (Q, K and V read one site)."""

    def __init__(self, floor: float) -> None:
        self.floor = floor
        self._roots: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}

    def get(self, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(C^{1/2}, C^{-1/2})`` (the cache keeps ``C`` alive, so its id stays unique)."""
        if id(C) not in self._roots:
            self._roots[id(C)] = (C, psd_roots(C, self.floor))
        return self._roots[id(C)][1]


@dataclass
class TypeFactors:
    """Factors of one matrix type for every layer, ready to build modules."""

    method: str
    """The registered method that produced them (``shared``, ``hybrid``, ``svd``,
    ``basis-sharing``, …): the one whose ``build_modules`` reads them."""
    ranks: TypeRanks
    groups: list[list[int]] = field(default_factory=list)
    """Layers that share a basis (``basis-sharing``; one group of all layers for
    ``shared``/``hybrid``; one layer each for ``svd``)."""
    parts: int = 1
    """Row blocks factorised separately (a gated MLP-in under ``svd``/``basis-sharing``)."""
    bases: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per group: ``P`` ``(k_in, in)`` and ``U`` ``(out, k_out)`` (``shared``/``hybrid``),
    or ``P0``, ``P1``, … per part (``basis-sharing``)."""
    per_layer: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per layer: ``core`` (+ ``res_b``, ``res_c``) / ``B0``, ``C0``, … / ``D0``, …"""
    energy: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


def kept_energy(W: torch.Tensor, What: torch.Tensor, root: torch.Tensor) -> float:
    """``1 − ||(W − Ŵ) R||² / ||W R||²`` with ``R = C^{1/2}`` (float64)."""
    err = ((W.double() - What.double()) @ root).pow(2).sum()
    return float(1.0 - err / (W.double() @ root).pow(2).sum())


def part_rows(out: int, parts: int) -> int:
    """Rows of one of ``parts`` equal row blocks of an ``out``-row matrix."""
    if out % parts:
        raise ValueError(f"{out} rows do not split into {parts} equal parts")
    return out // parts


def split_bias(b: torch.Tensor | None, parts: int) -> list[torch.Tensor | None]:
    """The bias of each row block (``None`` each for no bias)."""
    return [None] * parts if b is None else list(b.chunk(parts))


def meta_tensor(*shape: int) -> torch.Tensor:
    """An empty tensor on the ``meta`` device (a placeholder factor: no memory)."""
    return torch.empty(*shape, device="meta")
