"""structlm's own decoder (``StructLMForCausalLM``): fused ``qkv`` ``nn.Linear`` with
bias, output ``proj``, SwiGLU ``gate``/``up``/``down`` (dense or algebra layers).

Algebra FFN matrices can be analysed (their ``weight`` holds every block) but not
replaced: a factorised module would ignore the position types."""

from __future__ import annotations

import torch
from torch import nn

from structlm.hf.adapters.base import (
    LayerAdapter,
    LinearSite,
    MatrixType,
    ModelAdapter,
    PositionSource,
)
from structlm.hf.adapters.modules import (
    ConcatProjection,
    GatedMLP,
    linear_from,
    stacked,
    weight_and_bias,
)
from structlm.nn import AlgebraLinear

__all__ = ["StructLMAdapter"]

_QKV = (MatrixType.Q, MatrixType.K, MatrixType.V)


class StructLMLayerAdapter(LayerAdapter):
    """One ``StructLMBlock``."""

    def __init__(self, index: int, block: nn.Module, d: int) -> None:
        super().__init__(index)
        self.block, self.d = block, d

    def module(self, t: MatrixType) -> nn.Module:
        attn, mlp = self.block.attn, self.block.mlp
        if t in _QKV:
            return attn.qkv.parts[_QKV.index(t)] if isinstance(attn.qkv, ConcatProjection) \
                else attn.qkv
        if t is MatrixType.O:
            return attn.proj
        if isinstance(mlp, GatedMLP):
            return mlp.proj_in if t is MatrixType.MLP_IN else mlp.down
        if t is MatrixType.MLP_IN:
            raise ValueError("MLP-in of an unreplaced structlm MLP is two modules (gate, up)")
        return mlp.down

    def _weight_bias(self, t: MatrixType) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn, mlp = self.block.attn, self.block.mlp
        if t in _QKV and not isinstance(attn.qkv, ConcatProjection):
            w, b = weight_and_bias(attn.qkv)
            sl = slice(_QKV.index(t) * self.d, (_QKV.index(t) + 1) * self.d)
            return w[sl], None if b is None else b[sl]
        if t is MatrixType.MLP_IN and not isinstance(mlp, GatedMLP):
            return stacked(mlp.gate, mlp.up)
        return weight_and_bias(self.module(t))

    def site_module(self, site: str) -> nn.Module:
        attn, mlp = self.block.attn, self.block.mlp
        if site == "attn_in":
            return attn.qkv
        if site == "attn_out":
            return attn.proj
        if isinstance(mlp, GatedMLP):
            return mlp.proj_in if site == "mlp_in" else mlp.down
        return mlp.gate if site == "mlp_in" else mlp.down

    def linear_sites(self) -> list[LinearSite]:
        attn, mlp = self.block.attn, self.block.mlp
        if isinstance(attn.qkv, ConcatProjection) or isinstance(mlp, GatedMLP):
            raise ValueError(f"layer {self.index}: projections were replaced by a "
                             "compression; convert the original model instead")
        return [LinearSite(self.index, (MatrixType.Q, MatrixType.K, MatrixType.V), attn, "qkv"),
                LinearSite(self.index, (MatrixType.O,), attn, "proj"),
                LinearSite(self.index, (MatrixType.MLP_IN,), mlp, "gate"),
                LinearSite(self.index, (MatrixType.MLP_IN,), mlp, "up"),
                LinearSite(self.index, (MatrixType.MLP_OUT,), mlp, "down")]

    def _replace(self, t: MatrixType, module: nn.Module) -> None:
        attn, mlp = self.block.attn, self.block.mlp
        if t in (MatrixType.MLP_IN, MatrixType.MLP_OUT) and not isinstance(mlp, GatedMLP) \
                and isinstance(mlp.gate, AlgebraLinear):
            raise ValueError(f"layer {self.index}: cannot replace {t} of an algebra FFN "
                             f"({mlp.gate.algebra_name}): a factorised module would drop the "
                             "position types; compress attention only, or a dense model")
        if t in _QKV:
            if not isinstance(attn.qkv, ConcatProjection):
                w, b = weight_and_bias(attn.qkv)
                attn.qkv = ConcatProjection([
                    linear_from(w[i * self.d:(i + 1) * self.d],
                                None if b is None else b[i * self.d:(i + 1) * self.d])
                    for i in range(3)])
            attn.qkv.parts[_QKV.index(t)] = module
        elif t is MatrixType.O:
            attn.proj = module
        else:
            if not isinstance(mlp, GatedMLP):
                w, b = self._weight_bias(MatrixType.MLP_IN)
                self.block.mlp = mlp = GatedMLP(linear_from(w, b), mlp.down, w.shape[0] // 2)
            if t is MatrixType.MLP_IN:
                mlp.proj_in = module
            else:
                mlp.down = module


class StructLMAdapter(ModelAdapter):
    """``StructLMForCausalLM`` (model_type ``structlm``)."""

    family = "structlm"
    gated_mlp = True

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        d = model.config.hidden_size
        self._layers = [StructLMLayerAdapter(i, b, d) for i, b in enumerate(model.transformer.h)]

    @classmethod
    def handles(cls, model: nn.Module) -> bool:
        return getattr(getattr(model, "config", None), "model_type", None) == "structlm"

    @property
    def layers(self) -> list[LayerAdapter]:
        return list(self._layers)

    def position_source(self) -> PositionSource:
        # StructLMModel.forward: x = x + self.wpe(position_ids)
        return PositionSource(self.model.transformer.wpe, index=0)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)
