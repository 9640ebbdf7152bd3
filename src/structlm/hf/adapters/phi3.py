"""Phi-3 (``Phi3ForCausalLM``): a fused ``qkv_proj`` (queries, then keys, then values;
K and V narrower under grouped-query attention) and a fused ``gate_up_proj`` whose
output is ``[gate; up]`` — exactly the stacked MLP-in the other gated adapters build.
Q, K and V are sliced on analysis and split into three modules on replacement (as the
GPT-2 adapter does for ``c_attn``); MLP-in is the fused module itself."""

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
from structlm.hf.adapters.modules import ConcatProjection, linear_from, weight_and_bias

__all__ = ["Phi3Adapter"]

_QKV = (MatrixType.Q, MatrixType.K, MatrixType.V)


class Phi3LayerAdapter(LayerAdapter):
    """One ``Phi3DecoderLayer``."""

    def __init__(self, index: int, block: nn.Module, widths: tuple[int, int, int]) -> None:
        super().__init__(index)
        self.block = block
        self.widths = widths  # rows of Q, K, V in qkv_proj

    def _rows(self, t: MatrixType) -> slice:
        i = _QKV.index(t)
        start = sum(self.widths[:i])
        return slice(start, start + self.widths[i])

    def module(self, t: MatrixType) -> nn.Module:
        attn, mlp = self.block.self_attn, self.block.mlp
        if t in _QKV:
            return attn.qkv_proj.parts[_QKV.index(t)] if isinstance(
                attn.qkv_proj, ConcatProjection) else attn.qkv_proj
        if t is MatrixType.O:
            return attn.o_proj
        return mlp.gate_up_proj if t is MatrixType.MLP_IN else mlp.down_proj

    def _weight_bias(self, t: MatrixType) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn = self.block.self_attn
        if t in _QKV and not isinstance(attn.qkv_proj, ConcatProjection):
            w, b = weight_and_bias(attn.qkv_proj)
            rows = self._rows(t)
            return w[rows], None if b is None else b[rows]
        return weight_and_bias(self.module(t))

    def site_module(self, site: str) -> nn.Module:
        attn, mlp = self.block.self_attn, self.block.mlp
        return {"attn_in": attn.qkv_proj, "attn_out": attn.o_proj,
                "mlp_in": mlp.gate_up_proj, "mlp_out": mlp.down_proj}[site]

    def _replace(self, t: MatrixType, module: nn.Module) -> None:
        attn, mlp = self.block.self_attn, self.block.mlp
        if t in _QKV:
            if not isinstance(attn.qkv_proj, ConcatProjection):
                attn.qkv_proj = ConcatProjection(
                    [linear_from(*self._weight_bias(u)) for u in _QKV])
            attn.qkv_proj.parts[_QKV.index(t)] = module
        elif t is MatrixType.O:
            attn.o_proj = module
        elif t is MatrixType.MLP_IN:
            mlp.gate_up_proj = module
        else:
            mlp.down_proj = module

    def linear_sites(self) -> list[LinearSite]:
        attn, mlp = self.block.self_attn, self.block.mlp
        if isinstance(attn.qkv_proj, ConcatProjection):
            raise ValueError(f"layer {self.index}: qkv_proj was split by a compression; "
                             "convert the original model instead")
        return [LinearSite(self.index, _QKV, attn, "qkv_proj"),
                LinearSite(self.index, (MatrixType.O,), attn, "o_proj"),
                LinearSite(self.index, (MatrixType.MLP_IN,), mlp, "gate_up_proj"),
                LinearSite(self.index, (MatrixType.MLP_OUT,), mlp, "down_proj")]


class Phi3Adapter(ModelAdapter):
    """``Phi3ForCausalLM`` (Phi-3 mini / medium, Phi-4 mini)."""

    family = "phi3"
    gated_mlp = True
    notes = ("fused qkv_proj (Q/K/V sliced for analysis, split on replacement) and fused "
             "gate_up_proj ([gate; up], MLP-in as stored)")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        cfg = model.config
        head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = cfg.num_key_value_heads or cfg.num_attention_heads
        widths = (cfg.num_attention_heads * head, kv * head, kv * head)
        self._layers = [Phi3LayerAdapter(i, b, widths) for i, b in enumerate(model.model.layers)]

    @classmethod
    def handles(cls, model: nn.Module) -> bool:
        return getattr(getattr(model, "config", None), "model_type", None) == "phi3"

    @property
    def layers(self) -> list[LayerAdapter]:
        return list(self._layers)

    def position_source(self) -> PositionSource:
        # Phi3Model.forward: self.rotary_emb(hidden_states, position_ids=position_ids)
        return PositionSource(self.model.model.rotary_emb, keyword="position_ids", index=1)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)
