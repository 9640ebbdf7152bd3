"""The CPU decode kernels for any converted (or dense) Hugging Face model, and the MAC
ideal of its decode steps.

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

from fractions import Fraction

from torch import nn

from ..nn import DecodeLinear
from .baselines import projection_macs

__all__ = ["decode_macs_per_token", "use_decode_kernels_"]


def use_decode_kernels_(model: nn.Module) -> int:
    """Turn every exact ``nn.Linear`` of ``model`` into a ``DecodeLinear`` in place (the
    same parameter objects); returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = DecodeLinear
            n += 1
    return n


def decode_macs_per_token(model: nn.Module, context: float) -> Fraction:
    """Multiply-adds of one decode step at an average ``context``: the decoder's
    projections (:func:`~structlm.convert.baselines.projection_macs`), attention scores
    and weighted values (``2 · seen · heads · head_dim`` per layer, ``seen`` the context,
    or the sliding window of a sliding-window layer: Gemma 2/3's local layers, Mistral)
    and the LM head."""
    cfg = getattr(model.config, "text_config", None) or model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    attention = Fraction(0)
    for i in range(cfg.num_hidden_layers):
        sliding = window and (layer_types[i] == "sliding_attention" if layer_types
                              else True)  # Mistral-style: every layer slides
        seen = min(context, window) if sliding else context
        attention += Fraction(2 * seen * heads * head_dim)
    head = model.get_output_embeddings()
    return projection_macs(model) + attention + head.weight.numel()
