"""Model adapters: blocks and matrix types of a causal LM, without attribute names
leaking into the compression code. ``get_adapter(model)`` picks the right one."""

from __future__ import annotations

from torch import nn

from .base import (
    MATRIX_TYPES,
    SITE_OF,
    LayerAdapter,
    LinearSite,
    MatrixType,
    ModelAdapter,
    PositionSource,
    parse_types,
)
from .gpt2 import GPT2Adapter
from .llama import LlamaAdapter
from .modules import ConcatProjection, GatedMLP, linear_from
from .structlm import StructLMAdapter

__all__ = ["ADAPTERS", "MATRIX_TYPES", "SITE_OF", "ConcatProjection", "GPT2Adapter",
           "GatedMLP", "LayerAdapter", "LinearSite", "LlamaAdapter", "MatrixType", "ModelAdapter",
           "PositionSource",
           "StructLMAdapter", "get_adapter", "linear_from", "parse_types"]

ADAPTERS: list[type[ModelAdapter]] = [GPT2Adapter, LlamaAdapter, StructLMAdapter]
"""Registered adapters, tried in order."""


def get_adapter(model: nn.Module) -> ModelAdapter:
    """The adapter for ``model``; a clear error naming its ``model_type`` otherwise."""
    for cls in ADAPTERS:
        if cls.handles(model):
            return cls(model)
    mt = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    raise ValueError(f"no adapter for model_type {mt!r}: supported families are gpt2, "
                     f"llama/mistral/qwen2/qwen3 and structlm (add one in "
                     f"structlm/share/adapters/)")
