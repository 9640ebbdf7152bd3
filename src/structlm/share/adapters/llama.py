"""LLaMA family (``LlamaForCausalLM`` and look-alikes: SmolLM2, Mistral, Qwen2):
separate ``q/k/v/o_proj`` (K and V narrower under grouped-query attention), a gated MLP
``down(silu(gate(x)) * up(x))`` whose MLP-in is the stacked ``[gate; up]``."""

from __future__ import annotations

import torch
from torch import nn

from .base import LayerAdapter, LinearSite, MatrixType, ModelAdapter, PositionSource
from .modules import GatedMLP, stacked, weight_and_bias

__all__ = ["LlamaAdapter"]

_ATTN = {MatrixType.Q: "q_proj", MatrixType.K: "k_proj", MatrixType.V: "v_proj",
         MatrixType.O: "o_proj"}


class LlamaLayerAdapter(LayerAdapter):
    """One ``LlamaDecoderLayer``."""

    def __init__(self, index: int, block: nn.Module) -> None:
        super().__init__(index)
        self.block = block

    def module(self, t: MatrixType) -> nn.Module:
        if t in _ATTN:
            return getattr(self.block.self_attn, _ATTN[t])
        mlp = self.block.mlp
        if isinstance(mlp, GatedMLP):
            return mlp.proj_in if t is MatrixType.MLP_IN else mlp.down
        if t is MatrixType.MLP_IN:
            raise ValueError("MLP-in of an unreplaced LLaMA MLP is two modules (gate_proj, "
                             "up_proj); use weight() for the stacked matrix")
        return mlp.down_proj

    def _weight_bias(self, t: MatrixType) -> tuple[torch.Tensor, torch.Tensor | None]:
        mlp = self.block.mlp
        if t is MatrixType.MLP_IN and not isinstance(mlp, GatedMLP):
            return stacked(mlp.gate_proj, mlp.up_proj)
        return weight_and_bias(self.module(t))

    def site_module(self, site: str) -> nn.Module:
        attn, mlp = self.block.self_attn, self.block.mlp
        if site == "attn_in":
            return attn.q_proj
        if site == "attn_out":
            return attn.o_proj
        if isinstance(mlp, GatedMLP):
            return mlp.proj_in if site == "mlp_in" else mlp.down
        return mlp.gate_proj if site == "mlp_in" else mlp.down_proj

    def linear_sites(self) -> list[LinearSite]:
        attn, mlp = self.block.self_attn, self.block.mlp
        if isinstance(mlp, GatedMLP):
            raise ValueError(f"layer {self.index}: the MLP was replaced by a GatedMLP (a "
                             "compressed model); convert the original model instead")
        return [*(LinearSite(self.index, (t,), attn, name) for t, name in _ATTN.items()),
                LinearSite(self.index, (MatrixType.MLP_IN,), mlp, "gate_proj"),
                LinearSite(self.index, (MatrixType.MLP_IN,), mlp, "up_proj"),
                LinearSite(self.index, (MatrixType.MLP_OUT,), mlp, "down_proj")]

    def replace(self, t: MatrixType, module: nn.Module) -> None:
        if t in _ATTN:
            setattr(self.block.self_attn, _ATTN[t], module)
        elif t is MatrixType.MLP_IN:
            mlp = self.block.mlp
            if isinstance(mlp, GatedMLP):
                mlp.proj_in = module
            else:  # the new module replaces gate and up at once: nothing to stack
                self.block.mlp = GatedMLP(module, mlp.down_proj, mlp.gate_proj.out_features,
                                          mlp.act_fn)
        elif isinstance(self.block.mlp, GatedMLP):
            self.block.mlp.down = module
        else:
            self.block.mlp.down_proj = module


class LlamaAdapter(ModelAdapter):
    """LLaMA-architecture causal LMs (SmolLM2, TinyLlama, Mistral, Qwen2, ...)."""

    family = "llama"
    gated_mlp = True
    model_types = ("llama", "mistral", "qwen2", "qwen3")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._layers = [LlamaLayerAdapter(i, b) for i, b in enumerate(model.model.layers)]

    @classmethod
    def handles(cls, model: nn.Module) -> bool:
        return getattr(getattr(model, "config", None), "model_type", None) in cls.model_types

    @property
    def layers(self) -> list[LayerAdapter]:
        return list(self._layers)

    def position_source(self) -> PositionSource:
        # LlamaModel.forward: self.rotary_emb(hidden_states, position_ids=position_ids)
        return PositionSource(self.model.model.rotary_emb, keyword="position_ids", index=1)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)
