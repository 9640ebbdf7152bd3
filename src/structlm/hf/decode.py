"""The CPU decode kernels for any converted (or dense) Hugging Face model.

A converted model's algebra layers already decode on the compiled few-row kernel (their
types arrive as a :class:`~structlm.ops.partition.TypePartition`, the kernel's gate).
:func:`use_decode_kernels_` puts the model's plain ``nn.Linear`` s (attention
projections, a dense FFN, the LM head) on the same kernel by turning them into
:class:`~structlm.nn.DecodeLinear` (a subclass with the same parameters, same state dict:
only its few-row CPU calls change). Apply it to *both* models of a speed comparison: the
fairness rule of the generation benchmark (MKL's GEMV is slower than the kernel on this
machine, and an algebra layer on the kernel against a dense layer on MKL would credit
the algebra with the kernel).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from structlm.nn import DecodeLinear

__all__ = ["output_cache", "use_decode_kernels_"]


def use_decode_kernels_(model: nn.Module) -> int:
    """Turn every exact ``nn.Linear`` of ``model`` into a ``DecodeLinear`` in place (the
    same parameter objects); returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = DecodeLinear
            n += 1
    return n


def output_cache(out: Any) -> Any:
    """The KV cache a ``transformers`` forward returned (``cache``; ``past_key_values``
    before transformers 5.x renamed it)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
