"""An :class:`~structlm.nn.AlgebraLinear` that takes its position types from the model it
sits in, so it can replace an ``nn.Linear`` whose caller passes only ``x``.

A converted model holds one :class:`PositionTypes` source. A forward pre-hook on the
module that receives the model's own position ids (the adapter's
:class:`~structlm.hf.adapters.PositionSource`: LLaMA's rotary embedding, GPT-2's and
StructLM's ``wpe``) stores them at the start of every forward — as the model computed
them, so KV-cache offsets, chunked prefill and left padding (``generate()`` gives padded
rows positions from the attention mask) reach every converted layer. Each
:class:`TypedAlgebraLinear` then asks the source for the :class:`TypePartition` of its
input's rows (built once per forward and schedule, shared by all layers).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from structlm.nn import AlgebraLinear
from structlm.nn.schedules import TypeSchedule
from structlm.ops.partition import TypePartition

__all__ = ["PositionTypes", "TypedAlgebraLinear"]


class PositionTypes:
    """The position ids of the forward in progress and the type partitions derived from
    them (one per layer schedule and row shape)."""

    def __init__(self, schedule: TypeSchedule) -> None:
        self.schedule = schedule
        self.positions: torch.Tensor | None = None
        self._parts: dict[tuple[Any, ...], TypePartition] = {}

    def set_positions(self, positions: torch.Tensor) -> None:
        """Called by the hook at the start of every forward: ``positions (B, T)`` or
        ``(1, T)`` / ``(T,)`` broadcast over the batch."""
        if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point:
            raise TypeError(f"position ids must be an integer tensor, got {positions!r}")
        self.positions = positions
        self._parts.clear()

    def partition(self, layer: int, lead: torch.Size, q: int) -> TypePartition:
        """Types of the rows of an input with leading shape ``lead`` (``(B, T)``) in
        decoder layer ``layer``."""
        if self.positions is None:
            raise RuntimeError("a converted layer ran before the model's position ids were "
                               "seen: call the model (not the layer alone), or pass types")
        schedule = self.schedule.at_layer(layer)
        key = (schedule, tuple(lead))
        part = self._parts.get(key)
        if part is None:
            pos = self.positions
            if pos.dim() == 1:
                pos = pos.unsqueeze(0)
            if len(lead) != 2 or pos.shape[-1] != lead[-1] or pos.shape[0] not in (1, lead[0]):
                raise ValueError(f"position ids of shape {tuple(self.positions.shape)} do not "
                                 f"match a converted layer's input rows {tuple(lead)} "
                                 "(expected (batch, tokens))")
            types = schedule(pos.expand(*lead))  # (B, T)
            part = TypePartition(types.reshape(-1), q)
            self._parts[key] = part
        return part


class TypedAlgebraLinear(AlgebraLinear):
    """``AlgebraLinear`` for a converted model: ``forward(x)`` reads the types of ``x``'s
    rows from the model's :class:`PositionTypes` (``forward(x, types)`` still works).

    ``conv1d_layout`` keeps a GPT-2 ``Conv1D``'s ``(in, out)`` weight layout in the state
    dict (the module computes with ``(out, in)``), so a converted GPT-2 saves the same
    tensors, under the same names and shapes, as the original.

    Shapes: ``(B, T, in_features) -> (B, T, out_features)``.
    """

    def __init__(self, *args: Any, source: PositionTypes, layer_index: int,
                 conv1d_layout: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__["_source"] = source  # not a submodule: shared by every layer
        self.layer_index = layer_index
        self.conv1d_layout = conv1d_layout

    @property
    def position_types(self) -> PositionTypes:
        """The model's position-type source this layer reads its rows' types from."""
        return self.__dict__["_source"]

    def forward(self, x: torch.Tensor,
                types: torch.Tensor | TypePartition | None = None) -> torch.Tensor:
        if types is None:
            types = self.__dict__["_source"].partition(self.layer_index, x.shape[:-1], self.q)
        return super().forward(x, types)  # (B, T, N)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.conv1d_layout:
            w = destination[prefix + "weight"]
            destination[prefix + "weight"] = w.t() if keep_vars else w.t().contiguous()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        key = prefix + "weight"
        if self.conv1d_layout and key in state_dict:
            state_dict = {**state_dict, key: state_dict[key].t()}
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", layer={self.layer_index}, types from positions"


def dense_from(layer: TypedAlgebraLinear, conv1d_cls: type | None = None) -> nn.Module:
    """The dense module with ``layer``'s parameters, bit for bit: an ``nn.Linear`` (or a
    GPT-2 ``Conv1D`` when ``conv1d_cls`` is given)."""
    with torch.no_grad():
        if conv1d_cls is not None:
            out = conv1d_cls(layer.out_features, layer.in_features)
            out.to(device=layer.weight.device, dtype=layer.weight.dtype)
            out.weight.copy_(layer.weight.t())
            if layer.bias is not None:
                out.bias.copy_(layer.bias)
            return out
        out = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                        device=layer.weight.device, dtype=layer.weight.dtype)
        out.weight.copy_(layer.weight)
        if layer.bias is not None:
            out.bias.copy_(layer.bias)
        return out
