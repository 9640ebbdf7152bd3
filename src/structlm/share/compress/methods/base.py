"""The protocol every compression method implements, the plan of one matrix type, and the
registry of methods by name.

A method is one object (:class:`CompressionMethod`) that the generic code
(:func:`~structlm.share.compress.apply.compress_model`, the accounting in
:mod:`~structlm.share.compress.ranks`, the loader in :mod:`~structlm.share.compress.io`)
asks, per matrix type: which method and layer groups compress it, its ranks without and
with a parameter budget, its factors, its modules, what they store and cost per token, and
empty factors of the recorded shapes to load saved tensors into. Registering an instance
(:func:`register`) makes it a valid ``CompressionConfig.method``.

A method may have an update step after every type is replaced (:meth:`CompressionMethod.update`):
optional for Basis Sharing (``BasisSharingOptions.update``), part of the method for
``svd-llm`` (:attr:`CompressionMethod.always_updates`).

Former names: :data:`_RENAMED` ones are refused with what to use instead; :data:`ALIASES`
(``svd``, now ``svd-llm-w``) still resolve, with a ``DeprecationWarning``, wherever a
method name is read (:func:`canonical_name`, :func:`get_method`).
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from structlm.hf.adapters import MatrixType, ModelAdapter
from structlm.hf.calibration import Calibration
from structlm.share.compress.factorize import RootCache, TypeFactors, TypeRanks

__all__ = ["ALIASES", "METHODS", "CompressionMethod", "LayoutOptions", "TypePlan",
           "canonical_name", "get_method", "register"]


@dataclass
class TypePlan:
    """How one matrix type is compressed: the effective method (``svd-llm-w`` for Basis
    Sharing's private types), its ranks (``None`` when the method chooses them from the
    data under ``budget``, as ``shared``/``hybrid`` do), the budget, groups, parts and the
    per-layer residual rank."""

    type: MatrixType
    method: str
    shape: tuple[int, int]
    ranks: TypeRanks | None
    budget: float | None
    groups: list[list[int]]
    parts: int
    residual_rank: int = 0
    """The residual rank ``r`` of a method with a residual (also when ``ranks`` is
    ``None``); 0 otherwise."""


class LayoutOptions(Protocol):
    """What of ``CompressionConfig`` decides a method's layout: Basis Sharing's options
    (:class:`~structlm.share.compress.methods.basis_sharing.BasisSharingOptions`)."""

    basis_sharing: Any


class CompressionMethod(ABC):
    """One compression method. Subclasses set :attr:`name` and the flags, and implement
    the abstract methods; every tensor argument named ``weights`` is ``(out, in)`` per
    layer, every ``Cs`` a float64 input second moment per layer."""

    name: str
    """The ``CompressionConfig.method`` value (and ``TypeFactors.method``)."""
    two_sided: bool = False
    """Shared output *and* input bases with per-layer cores (``U A_l P``)."""
    shares_across_layers: bool = True
    """Some factor is shared by several layers (False for the per-layer ``svd-llm-w`` and
    ``svd-llm``)."""
    has_residual: bool = False
    """A per-layer residual of rank ``HybridOptions.residual_rank``."""
    splits_row_blocks: bool = False
    """Factorise a type's row blocks (a gated MLP-in's gate and up) on their own."""
    always_updates: bool = False
    """The method's :meth:`update` is part of it (``svd-llm``'s layer-wise refit):
    :func:`~structlm.share.compress.apply.compress_model` runs it after every type is
    replaced whatever ``BasisSharingOptions.update`` says, and needs the calibration tokens
    for it."""

    def __repr__(self) -> str:
        return f"<compression method {self.name!r}>"

    @property
    def supports_update(self) -> bool:
        """Whether ``BasisSharingOptions.update`` may switch on an *optional* update step
        (:meth:`update` implemented and not :attr:`always_updates`)."""
        return not self.always_updates and type(self).update is not CompressionMethod.update

    def runs_update(self, requested: bool) -> bool:
        """Whether :func:`~structlm.share.compress.apply.compress_model` runs
        :meth:`update` (``requested``: ``BasisSharingOptions.update``)."""
        return self.always_updates or (requested and self.supports_update)

    def layout(self, t: MatrixType, num_layers: int, options: LayoutOptions
               ) -> tuple[CompressionMethod, list[list[int]]]:
        """The method that compresses type ``t`` under this configured method, and its
        layer groups (by default: this method, :meth:`default_groups`)."""
        return self, self.default_groups(num_layers)

    def default_groups(self, num_layers: int) -> list[list[int]]:
        """The method's layer groups without configuration (also those of a saved
        manifest that does not record them): one layer each, unless overridden."""
        return [[i] for i in range(num_layers)]

    @abstractmethod
    def default_ranks(self, k: int, shape: tuple[int, int], group_sizes: list[int],
                      parts: int, r: int) -> TypeRanks:
        """The ranks without a budget: ``k`` (``k_fraction`` × hidden size) as far as
        the method's algebra allows; ``r`` the residual rank (0 without residual)."""

    @abstractmethod
    def budget_ranks(self, shape: tuple[int, int], group_sizes: list[int], parts: int,
                     budget: float, r: int) -> TypeRanks | None:
        """The ranks whose :meth:`stored_parameters` fit ``budget`` (``L`` =
        ``sum(group_sizes)`` layers of ``shape``), or ``None`` if :meth:`factorize`
        chooses them from the data."""

    @abstractmethod
    def factorize(self, plan: TypePlan, weights: list[torch.Tensor], Cs: Sequence[torch.Tensor],
                  floor: float, roots: RootCache) -> TypeFactors:
        """The factors of one type under ``plan`` (``floor``: relative eigenvalue floor of
        the whitening roots; ``roots``: shared across the types that read one site)."""

    @abstractmethod
    def build_modules(self, factors: TypeFactors, biases: list[torch.Tensor | None]
                      ) -> list[nn.Module]:
        """One replacement module per layer from ``factors`` (layers of a group share
        one basis module)."""

    @abstractmethod
    def stored_parameters(self, out: int, inn: int, ranks: TypeRanks,
                          group_sizes: list[int], parts: int = 1) -> int:
        """Parameters stored for one type over ``sum(group_sizes)`` layers (biases are
        unchanged and not counted)."""

    @abstractmethod
    def token_macs(self, out: int, inn: int, ranks: TypeRanks, group_sizes: list[int],
                   parts: int = 1) -> int:
        """Multiply-adds per token of one type summed over its layers, in the order the
        modules take for one row."""

    @abstractmethod
    def placeholder(self, shape: tuple[int, int], ranks: TypeRanks, groups: list[list[int]],
                    parts: int) -> TypeFactors:
        """Factors of the recorded ranks, groups and parts on the ``meta`` device (what
        :func:`~structlm.share.compress.io.load_compressed` assigns saved tensors to)."""

    def update(self, adapter: ModelAdapter, cal: Calibration, plans: list[TypePlan],
               originals: dict[MatrixType, list[torch.Tensor]], tokens: torch.Tensor,
               floor: float) -> dict[str, Any]:
        """A step after every type is replaced (optional, ``BasisSharingOptions.update``, or
        always, :attr:`always_updates`): ``originals`` holds the dense weights of every
        planned type, ``tokens`` the calibration windows; returns the report's
        ``"update"`` entry (per type)."""
        raise NotImplementedError(f"method {self.name!r} has no update step")


METHODS: dict[str, CompressionMethod] = {}
"""Registered methods by name, in registration order (the built-in ones: ``shared``,
``hybrid``, ``svd-llm-w``, ``svd-llm``, ``basis-sharing``, ``onesided-all-layers``)."""

_RENAMED = {"onesided": "method 'onesided' was renamed: use 'onesided-all-layers' (one input "
                        "basis across every layer) or 'basis-sharing' (groups of consecutive "
                        "layers, as in the Basis Sharing paper)"}
"""Former names that are refused (the message says what to use)."""

ALIASES: dict[str, tuple[str, str]] = {
    "svd": ("svd-llm-w", "method 'svd' is deprecated: it is 'svd-llm-w' (SVD-LLM's "
                         "truncation-aware whitening without its update); 'svd-llm' is "
                         "SVD-LLM with the published layer-wise update"),
}
"""Former names that still resolve: ``{old: (new, warning)}`` (a ``DeprecationWarning``
each time one is read)."""


def canonical_name(name: str) -> str:
    """``name``, or the method a deprecated alias stands for (with a
    ``DeprecationWarning``); the name is not checked otherwise."""
    if name in ALIASES and name not in METHODS:
        new, message = ALIASES[name]
        warnings.warn(message, DeprecationWarning, stacklevel=3)
        return new
    return name


def register(method: CompressionMethod) -> CompressionMethod:
    """Add ``method`` to :data:`METHODS` under its name (which must be new); returns it."""
    if not getattr(method, "name", ""):
        raise ValueError(f"{method!r} needs a non-empty name")
    if method.name in METHODS or method.name in _RENAMED or method.name in ALIASES:
        raise ValueError(f"a compression method named {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> CompressionMethod:
    """The registered method ``name`` (a deprecated alias resolves, with a
    ``DeprecationWarning``); a ``ValueError`` names an unknown value and the valid
    choices."""
    name = canonical_name(name)
    if name in METHODS:
        return METHODS[name]
    if name in _RENAMED:
        raise ValueError(_RENAMED[name])
    raise ValueError(f"unknown method {name!r}: expected one of {tuple(METHODS)}")
