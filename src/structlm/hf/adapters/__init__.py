"""Model adapters: blocks and matrix types of a causal LM, without attribute names
leaking into the compression code. ``get_adapter(model)`` picks the right one."""

from __future__ import annotations

from torch import nn

from structlm.hf.adapters.base import (
    MATRIX_TYPES,
    SITE_OF,
    LayerAdapter,
    LinearSite,
    MatrixType,
    ModelAdapter,
    PositionSource,
    parse_types,
)
from structlm.hf.adapters.gpt2 import GPT2Adapter
from structlm.hf.adapters.llama import LlamaAdapter
from structlm.hf.adapters.modules import ConcatProjection, GatedMLP, linear_from
from structlm.hf.adapters.phi3 import Phi3Adapter
from structlm.hf.adapters.structlm import StructLMAdapter

__all__ = [
    "ADAPTERS",
    "MATRIX_TYPES",
    "SITE_OF",
    "ConcatProjection",
    "GPT2Adapter",
    "GatedMLP",
    "LayerAdapter",
    "LinearSite",
    "LlamaAdapter",
    "MatrixType",
    "ModelAdapter",
    "Phi3Adapter",
    "PositionSource",
    "StructLMAdapter",
    "get_adapter",
    "linear_from",
    "parse_types",
    "supported_model_types",
]

ADAPTERS: list[type[ModelAdapter]] = [GPT2Adapter, LlamaAdapter, Phi3Adapter, StructLMAdapter]
"""Registered adapters, tried in order."""


def get_adapter(model: nn.Module) -> ModelAdapter:
    """The adapter for ``model``; a clear error naming its ``model_type`` otherwise."""
    for cls in ADAPTERS:
        if cls.handles(model):
            return cls(model)
    mt = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    raise ValueError(f"no adapter for model_type {mt!r}: supported model_types are "
                     f"{', '.join(supported_model_types())} (add one in "
                     f"structlm/hf/adapters/)")


def supported_model_types() -> list[str]:
    """Every ``config.model_type`` an adapter handles."""
    return ["gpt2", *LlamaAdapter.model_types, "phi3", "structlm"]
