"""Adapters: the only place that knows a model family's attribute names.

A :class:`ModelAdapter` exposes a causal LM as a list of :class:`LayerAdapter` (one per
Transformer block). Each block has six matrix types (:class:`MatrixType`): Q, K, V, O,
MLP-in, MLP-out. Every matrix is returned in ``nn.Linear`` orientation ``(out, in)``
(``y = x W^T + b``), whatever the model stores (GPT-2's ``Conv1D`` keeps ``(in, out)``;
fused ``c_attn``/``qkv`` projections are sliced).

Gated MLPs (LLaMA, structlm's SwiGLU): **MLP-in is the stacked matrix
``[W_gate; W_up]`` of shape ``(2F, d)``** — both read the same input, so they share one
input covariance and one input-side basis; replacing MLP-in swaps the MLP for an
equivalent :class:`~structlm.hf.adapters.modules.GatedMLP` that computes ``act(g) * u``
from one ``(2F, d)`` projection.

Each matrix type reads an *input site* (Q, K and V read the same normed hidden state):
calibration hooks one module per site, so the covariance is computed once per site.
Adding an architecture is one small file subclassing these two classes and registering
itself in :data:`structlm.hf.adapters.ADAPTERS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import nn

from structlm.nn.structure import invalidate_fast_paths

__all__ = ["MATRIX_TYPES", "SITE_OF", "LayerAdapter", "LinearSite", "MatrixType",
           "ModelAdapter", "PositionSource", "parse_types"]


class MatrixType(StrEnum):
    """The six matrix types of a Transformer block."""

    Q = "q"
    K = "k"
    V = "v"
    O = "o"  # noqa: E741
    MLP_IN = "mlp_in"
    MLP_OUT = "mlp_out"


MATRIX_TYPES: tuple[MatrixType, ...] = tuple(MatrixType)

SITE_OF: dict[MatrixType, str] = {
    MatrixType.Q: "attn_in", MatrixType.K: "attn_in", MatrixType.V: "attn_in",
    MatrixType.O: "attn_out", MatrixType.MLP_IN: "mlp_in", MatrixType.MLP_OUT: "mlp_out",
}
"""Input site of each type: matrices with the same site read the same activations."""

_GROUPS = {"attn": [MatrixType.Q, MatrixType.K, MatrixType.V, MatrixType.O],
           "mlp": [MatrixType.MLP_IN, MatrixType.MLP_OUT], "all": list(MATRIX_TYPES)}


def parse_types(spec: str | list[str] | tuple[str, ...]) -> list[MatrixType]:
    """Matrix types from ``"q,k,v"``, ``"attn"``, ``"mlp"``, ``"all"`` or a list of names."""
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[MatrixType] = []
    for p in (str(p).strip().lower() for p in parts):
        if not p:
            continue
        if p in _GROUPS:
            new = _GROUPS[p]
        else:
            try:
                new = [MatrixType(p)]
            except ValueError:
                raise ValueError(f"unknown matrix type {p!r}: expected one of "
                                 f"{[t.value for t in MATRIX_TYPES]} or "
                                 f"{sorted(_GROUPS)}") from None
        out.extend(t for t in new if t not in out)
    if not out:
        raise ValueError(f"no matrix types in {spec!r}")
    return out


@dataclass(frozen=True)
class LinearSite:
    """One stored projection module of a block (a leaf ``nn.Linear`` or GPT-2 ``Conv1D``)
    and the matrix types it computes (a fused qkv computes three; LLaMA's MLP-in is two
    sites, ``gate_proj`` and ``up_proj``)."""

    layer: int
    types: tuple[MatrixType, ...]
    parent: nn.Module
    attr: str

    @property
    def module(self) -> nn.Module:
        return getattr(self.parent, self.attr)


@dataclass(frozen=True)
class PositionSource:
    """The module whose forward receives the model's position ids ``(B, T)`` (as the
    model itself computed them: offsets of a KV cache, left padding), and where: a
    keyword name or a positional index."""

    module: nn.Module
    keyword: str | None = None
    index: int = 0


class LayerAdapter(ABC):
    """One Transformer block: its matrices, their input modules, and replacement."""

    def __init__(self, index: int) -> None:
        self.index = index

    @abstractmethod
    def _weight_bias(self, t: MatrixType) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stored ``(out, in)`` matrix of type ``t`` and its bias (views, any dtype)."""

    def weight(self, t: MatrixType) -> torch.Tensor:
        """The matrix of type ``t``, ``(out, in)``, a detached float32 copy."""
        return self._weight_bias(t)[0].detach().float().clone()

    def bias(self, t: MatrixType) -> torch.Tensor | None:
        """The bias of type ``t`` (``(out,)``, float32 copy) or ``None``."""
        b = self._weight_bias(t)[1]
        return None if b is None else b.detach().float().clone()

    @abstractmethod
    def site_module(self, site: str) -> nn.Module:
        """The module whose forward input is the activation read at ``site``."""

    def replace(self, t: MatrixType, module: nn.Module) -> None:
        """Make the block compute matrix ``t`` with ``module`` (maps ``(..., in)`` to
        ``(..., out)``, bias included); cached fast-path decisions are rebuilt
        (:func:`structlm.nn.invalidate_fast_paths`)."""
        self._replace(t, module)
        invalidate_fast_paths(self.block)

    @abstractmethod
    def _replace(self, t: MatrixType, module: nn.Module) -> None:
        """The family's :meth:`replace` (attribute names and fused modules)."""

    @abstractmethod
    def module(self, t: MatrixType) -> nn.Module:
        """The module currently computing matrix ``t`` (after replacements too)."""

    @abstractmethod
    def linear_sites(self) -> list[LinearSite]:
        """The block's stored projection modules, one site per module (for conversion:
        each is replaced in place by a module with the same parameters)."""


class ModelAdapter(ABC):
    """A causal LM seen through its blocks and matrix types."""

    family: str = ""
    notes: str = ""
    """The family's architectural differences where they matter to the share and convert
    reports (post-norms, multi-query K/V, ...); empty for the plain pre-norm families."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @classmethod
    @abstractmethod
    def handles(cls, model: nn.Module) -> bool:
        """Whether this adapter understands ``model``."""

    @property
    @abstractmethod
    def layers(self) -> list[LayerAdapter]:
        """One adapter per block, in depth order."""

    @property
    @abstractmethod
    def hidden_size(self) -> int:
        """Width of the residual stream."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def weights(self, t: MatrixType, layers: list[int] | None = None) -> list[torch.Tensor]:
        """Matrices of type ``t`` for ``layers`` (all by default), each ``(out, in)``."""
        idx = range(self.num_layers) if layers is None else layers
        return [self.layers[i].weight(t) for i in idx]

    def row_blocks(self, t: MatrixType) -> int:
        """Equal row blocks of matrix ``t`` that one hidden-unit permutation moves
        together (2 for a gated MLP's stacked ``[gate; up]``, else 1)."""
        return 2 if t is MatrixType.MLP_IN and self.gated_mlp else 1

    gated_mlp: bool = False
    """Whether MLP-in is a stacked ``[gate; up]``."""

    conv1d_layout: bool = False
    """Whether the projections store ``(in, out)`` weights (GPT-2's ``Conv1D``)."""

    @abstractmethod
    def position_source(self) -> PositionSource:
        """Where the model's position ids can be read during its forward."""

    def writes_residual(self, t: MatrixType) -> bool:
        """True for residual-stream writers (O, MLP-out), False for readers."""
        return t in (MatrixType.O, MatrixType.MLP_OUT)
