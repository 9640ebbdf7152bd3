"""Multiply-adds and stored parameters of a Hugging Face causal LM's projections, for
whatever modules it holds now (dense, algebra at its type mix, factorised, pruned), and
of one decode step."""

from __future__ import annotations

from fractions import Fraction

from torch import nn

from structlm.hf.adapters import get_adapter
from structlm.nn import AlgebraLinear
from structlm.nn.factorized import LowRankLinear, OneSidedLinear, SharedBasisLinear

__all__ = ["decode_bytes_per_token", "decode_macs_per_token", "kv_cache_bytes_per_token",
           "projection_macs", "projection_parameters"]


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


def _seen_per_layer(cfg: object, context: float) -> list[float]:
    """Positions each layer's attention reads at an average ``context`` (the sliding window
    of a sliding-window layer: Gemma 2/3's local layers, Mistral)."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    seen = []
    for i in range(cfg.num_hidden_layers):  # type: ignore[attr-defined]
        sliding = window and (layer_types[i] == "sliding_attention" if layer_types
                              else True)  # Mistral-style: every layer slides
        seen.append(min(context, window) if sliding else context)
    return seen


def decode_bytes_per_token(model: nn.Module, context: float) -> Fraction:
    """Bytes one decode token (batch 1) reads at an average ``context``: the weights each
    decoder projection uses (an algebra layer the blocks of one type: ``rho`` of its weight
    at a uniform type mix; a factorised or shared-basis module all its factors, a shared
    basis once per module that uses it) and their biases, the KV cache (K and V of every
    position seen, per layer), the LM head's weight and one embedding row. Norm weights
    are left out (under 0.1% of any adapted model). What the memory floor of a decode
    step is computed from."""
    total = Fraction(0)
    for block in _blocks(model):
        for m in block.modules():
            if isinstance(m, AlgebraLinear):
                size = next(m.parameters()).element_size()
                total += m.mac_ratio() * m.in_features * m.out_features * size
                if m.bias is not None:
                    total += m.bias.numel() * m.bias.element_size()
            elif (isinstance(m, nn.Linear | LowRankLinear | SharedBasisLinear | OneSidedLinear)
                  or _is_conv1d(m)):
                total += sum(p.numel() * p.element_size() for p in m.parameters())
    head = model.get_output_embeddings().weight
    total += kv_cache_bytes_per_token(model, context, head.element_size())
    embed = model.get_input_embeddings().weight
    return total + head.numel() * head.element_size() + embed.shape[1] * embed.element_size()


def kv_cache_bytes_per_token(model: nn.Module, context: float, element_size: int) -> Fraction:
    """Bytes of KV cache one decode token reads at an average ``context``: K and V of every
    position each layer sees (its KV heads, not its query heads), ``element_size`` bytes
    per value (4 for a float32 cache; llama.cpp keeps float16, 2)."""
    cfg = getattr(model.config, "text_config", None) or model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    kv_row = 2 * kv_heads * head_dim * element_size  # K and V of one position
    return sum((Fraction(seen) * kv_row for seen in _seen_per_layer(cfg, context)),
               Fraction(0))


def decode_macs_per_token(model: nn.Module, context: float) -> Fraction:
    """Multiply-adds of one decode step at an average ``context``: the decoder's
    projections (:func:`projection_macs`), attention scores
    and weighted values (``2 · seen · heads · head_dim`` per layer, ``seen`` the context,
    or the sliding window of a sliding-window layer: Gemma 2/3's local layers, Mistral)
    and the LM head."""
    cfg = getattr(model.config, "text_config", None) or model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    attention = sum((Fraction(2 * seen * heads * head_dim)
                     for seen in _seen_per_layer(cfg, context)), Fraction(0))
    head = model.get_output_embeddings()
    return projection_macs(model) + attention + head.weight.numel()
