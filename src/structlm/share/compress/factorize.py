"""What every compression method shares: ranks and factors of one matrix type across
layers, the whitening roots, the kept-energy measure and the split into row blocks.

Notation: ``W_l`` ``(out, in)``, ``C_l`` its input second moment, ``L`` layers; every
product is float64. The methods themselves (``shared``/``hybrid``, ``svd-llm-w``/``svd-llm``,
``basis-sharing``) live in :mod:`structlm.share.compress.methods`, one file each.

The per-layer ``energy`` is the functional energy kept under the layer's own input
statistics, ``1 − tr((W − Ŵ) C_l (W − Ŵ)ᵀ) / tr(W C_l Wᵀ)`` (no square root needed).
"""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from structlm.hf.fingerprint import tensor_fingerprint
from structlm.hf.linalg import psd_roots

__all__ = ["RootCache", "TypeFactors", "TypeRanks", "kept_energy", "meta_tensor",
           "owned_moment", "part_rows", "split_bias"]


@dataclass(frozen=True)
class TypeRanks:
    """Ranks of one matrix type: ``k_out`` × ``k_in`` cores for ``shared``/``hybrid``;
    ``k_out = k_in = k`` for ``svd-llm-w``/``svd-llm`` and the one-sided basis size; ``r``
    the hybrid's per-layer residual rank."""

    k_out: int
    k_in: int
    r: int = 0

    @property
    def k(self) -> int:
        """The input-side rank (the one-sided basis size, the SVD rank)."""
        return self.k_in


class RootCache:
    """``C^{1/2}`` and ``C^{-1/2}`` of input second moments, one ``eigh`` each, keyed on
    ``C``'s content (and the floor): reused by every type that reads the same matrix (Q,
    K and V read one site) and, with a ``store`` folder, by every later compression of
    the same calibration (a 4,864-wide root costs ~30 s of ``eigh`` on one core; every
    method at every budget asks for the same ones).

    In memory at most ``memory_bytes`` of roots are kept (least recently used dropped
    first; a pair larger than that is not kept at all); in ``store`` only roots of at
    least ``store_min_dim`` dimensions are written (smaller ones cost less to recompute
    than to read), atomically, as safetensors."""

    def __init__(self, floor: float, store: str | Path | None = None,
                 memory_bytes: int = 2 << 30, store_min_dim: int = 2048) -> None:
        if not floor >= 0 or memory_bytes < 0 or store_min_dim < 1:
            raise ValueError(f"RootCache needs floor >= 0, memory_bytes >= 0 and "
                             f"store_min_dim >= 1, got floor={floor}, memory_bytes="
                             f"{memory_bytes}, store_min_dim={store_min_dim}")
        self.floor = floor
        self.store = None if store is None else Path(store)
        self.memory_bytes = memory_bytes
        self.store_min_dim = store_min_dim
        self._roots: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.computed = 0
        """Roots computed by ``eigh`` (not found in memory or in the store)."""

    def _path(self, key: str) -> Path | None:
        return None if self.store is None else self.store / f"{key}.safetensors"

    def get(self, C: torch.Tensor, consume: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(C^{1/2}, C^{-1/2})`` (float64, eigenvalues floored). ``consume``: the caller
        owns ``C`` and never reads it again, so a root computed here decomposes it in
        its own storage (one ``dim²`` less at the peak; :func:`psd_roots`)."""
        key = f"{tensor_fingerprint(C)}-floor{self.floor!r}"
        if key in self._roots:
            self._roots.move_to_end(key)
            return self._roots[key]
        path = self._path(key) if C.shape[0] >= self.store_min_dim else None
        roots = _load_roots(path) if path is not None and path.exists() else None
        if roots is None:
            roots = psd_roots(C, self.floor, consume=consume)
            self.computed += 1
            if path is not None:
                _save_roots(path, roots)
        size = sum(r.numel() * r.element_size() for r in roots)
        if size > self.memory_bytes:  # larger than the whole budget: returned, not kept
            return roots
        self._roots[key] = roots
        used = sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self._roots.values())
        while used > self.memory_bytes and len(self._roots) > 1:
            a, b = self._roots.popitem(last=False)[1]
            used -= a.numel() * a.element_size() + b.numel() * b.element_size()
        return roots


def _load_roots(path: Path) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Roots saved by :func:`_save_roots` (``None``: an unreadable file, recomputed)."""
    from structlm.tensor_files import read_safetensors

    try:
        t = read_safetensors(path)
        return t["root"], t["inv_root"]
    except Exception:
        return None


def _save_roots(path: Path, roots: tuple[torch.Tensor, torch.Tensor]) -> None:
    from structlm.tensor_files import write_safetensors

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        write_safetensors({"root": roots[0], "inv_root": roots[1]}, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@dataclass
class TypeFactors:
    """Factors of one matrix type for every layer, ready to build modules."""

    method: str
    """The registered method that produced them (``shared``, ``hybrid``, ``svd-llm-w``,
    ``basis-sharing``, …): the one whose ``build_modules`` reads them."""
    ranks: TypeRanks
    groups: list[list[int]] = field(default_factory=list)
    """Layers that share a basis (``basis-sharing``; one group of all layers for
    ``shared``/``hybrid``; one layer each for ``svd-llm-w``/``svd-llm``)."""
    parts: int = 1
    """Row blocks factorised separately (a gated MLP-in under ``svd-llm-w``/``svd-llm``/
    ``basis-sharing``)."""
    bases: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per group: ``P`` ``(k_in, in)`` and ``U`` ``(out, k_out)`` (``shared``/``hybrid``),
    or ``P0``, ``P1``, … per part (``basis-sharing``)."""
    per_layer: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per layer: ``core`` (+ ``res_b``, ``res_c``) / ``B0``, ``C0``, … / ``D0``, …"""
    energy: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


def kept_energy(W: torch.Tensor, What: torch.Tensor, C: torch.Tensor) -> float:
    """``1 − tr(E C Eᵀ) / tr(W C Wᵀ)`` with ``E = W − Ŵ`` and ``C`` the input second
    moment (float64): the share of ``E||W x||²`` on the calibration inputs that ``Ŵ``
    keeps."""
    W, C = W.double(), C.double()
    E = W - What.double()
    err = ((E @ C) * E).sum()
    return float(1.0 - err / ((W @ C) * W).sum())


def owned_moment(Cs: Sequence[torch.Tensor], i: int) -> torch.Tensor:
    """``Cs[i]`` as a tensor the caller may overwrite (and so hand to
    ``RootCache.get(..., consume=True)``): a fresh read where ``Cs`` reads on use (a
    saved calibration's layer moments), else a copy."""
    owned = getattr(Cs, "owned", None)
    return owned(i) if callable(owned) else Cs[i].clone()


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
