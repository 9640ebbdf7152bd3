"""Multiply-adds and stored parameters of a Hugging Face causal LM's projections, for
whatever modules it holds now (dense, algebra at its type mix, factorised, pruned), and
of one decode step."""

from __future__ import annotations

from fractions import Fraction

from torch import nn

from structlm.hf.adapters import get_adapter
from structlm.nn import AlgebraLinear
from structlm.nn.factorized import LowRankLinear, OneSidedLinear, SharedBasisLinear

__all__ = ["decode_macs_per_token", "projection_macs", "projection_parameters"]


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"


def _blocks(model: nn.Module) -> list[nn.Module]:
    adapter = get_adapter(model)
    return [layer.block for layer in adapter.layers]


def projection_macs(model: nn.Module) -> Fraction:
    """Multiply-adds per token of every projection in the decoder blocks (attention and
    FFN; not the embeddings or the LM head), for the modules the model holds now: dense
    ``nn.Linear`` / ``Conv1D`` ``out·in``, an algebra layer ``rho·out·in`` at a uniform
    type mix (exact for cyclic schedules over whole periods), a factorised module the
    MACs of its factors."""
    total = Fraction(0)
    for block in _blocks(model):
        for m in block.modules():
            if isinstance(m, AlgebraLinear):
                total += m.mac_ratio() * m.in_features * m.out_features
            elif isinstance(m, nn.Linear) or _is_conv1d(m):
                total += m.weight.numel()
            elif isinstance(m, LowRankLinear):
                total += m.B.numel() + m.C.numel()  # r·out + r·in
            elif isinstance(m, SharedBasisLinear | OneSidedLinear):
                raise ValueError(f"projection_macs refuses a {type(m).__name__}: a shared "
                                 "basis's MACs depend on its association order, which this "
                                 "count does not model")
    return total


def projection_parameters(model: nn.Module) -> int:
    """Stored weight and bias elements of the decoder blocks' projections (a shared
    basis counted once)."""
    seen: set[int] = set()
    total = 0
    for block in _blocks(model):
        for m in block.modules():
            if isinstance(m, nn.Linear | AlgebraLinear | LowRankLinear) or _is_conv1d(m):
                for p in m.parameters(recurse=False):
                    if id(p) not in seen:
                        seen.add(id(p))
                        total += p.numel()
    return total


def decode_macs_per_token(model: nn.Module, context: float) -> Fraction:
    """Multiply-adds of one decode step at an average ``context``: the decoder's
    projections (:func:`projection_macs`), attention scores
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
