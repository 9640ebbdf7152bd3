"""GPT-2 family (``GPT2LMHeadModel``): ``Conv1D`` weights stored ``(in, out)``, a fused
``c_attn`` holding Q, K and V side by side, biases everywhere."""

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

__all__ = ["GPT2Adapter"]

_QKV = (MatrixType.Q, MatrixType.K, MatrixType.V)


class GPT2LayerAdapter(LayerAdapter):
    """One ``GPT2Block``."""

    def __init__(self, index: int, block: nn.Module, d: int) -> None:
        super().__init__(index)
        self.block, self.d = block, d

    def _qkv_split(self) -> ConcatProjection:
        """``c_attn`` as three ``nn.Linear`` (done once, on the first Q/K/V replacement)."""
        attn = self.block.attn
        if not isinstance(attn.c_attn, ConcatProjection):
            w, b = weight_and_bias(attn.c_attn)
            parts = [linear_from(w[i * self.d:(i + 1) * self.d],
                                 None if b is None else b[i * self.d:(i + 1) * self.d])
                     for i in range(3)]
            attn.c_attn = ConcatProjection(parts)
        return attn.c_attn

    def module(self, t: MatrixType) -> nn.Module:
        if t in _QKV:
            c = self.block.attn.c_attn
            if isinstance(c, ConcatProjection):
                return c.parts[_QKV.index(t)]
            return c
        return {MatrixType.O: self.block.attn.c_proj, MatrixType.MLP_IN: self.block.mlp.c_fc,
                MatrixType.MLP_OUT: self.block.mlp.c_proj}[t]

    def _weight_bias(self, t: MatrixType) -> tuple[torch.Tensor, torch.Tensor | None]:
        if t in _QKV and not isinstance(self.block.attn.c_attn, ConcatProjection):
            w, b = weight_and_bias(self.block.attn.c_attn)
            i = _QKV.index(t)
            sl = slice(i * self.d, (i + 1) * self.d)
            return w[sl], None if b is None else b[sl]
        return weight_and_bias(self.module(t))

    def site_module(self, site: str) -> nn.Module:
        return {"attn_in": self.block.attn.c_attn, "attn_out": self.block.attn.c_proj,
                "mlp_in": self.block.mlp.c_fc, "mlp_out": self.block.mlp.c_proj}[site]

    def linear_sites(self) -> list[LinearSite]:
        attn, mlp = self.block.attn, self.block.mlp
        if isinstance(attn.c_attn, ConcatProjection):
            raise ValueError(f"layer {self.index}: c_attn was split by a compression; "
                             "convert the original model instead")
        return [LinearSite(self.index, (MatrixType.Q, MatrixType.K, MatrixType.V), attn,
                           "c_attn"),
                LinearSite(self.index, (MatrixType.O,), attn, "c_proj"),
                LinearSite(self.index, (MatrixType.MLP_IN,), mlp, "c_fc"),
                LinearSite(self.index, (MatrixType.MLP_OUT,), mlp, "c_proj")]

    def _replace(self, t: MatrixType, module: nn.Module) -> None:
        if t in _QKV:
            self._qkv_split().parts[_QKV.index(t)] = module
        elif t is MatrixType.O:
            self.block.attn.c_proj = module
        elif t is MatrixType.MLP_IN:
            self.block.mlp.c_fc = module
        else:
            self.block.mlp.c_proj = module


class GPT2Adapter(ModelAdapter):
    """``GPT2LMHeadModel`` (gpt2, gpt2-medium, distilgpt2, ...)."""

    family = "gpt2"
    conv1d_layout = True
    notes = "Conv1D weights stored (in, out) (read transposed); fused c_attn (Q/K/V sliced)"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        d = model.config.n_embd
        self._layers = [GPT2LayerAdapter(i, b, d) for i, b in enumerate(model.transformer.h)]
        self._d = d

    @classmethod
    def handles(cls, model: nn.Module) -> bool:
        return getattr(getattr(model, "config", None), "model_type", None) == "gpt2"

    @property
    def layers(self) -> list[LayerAdapter]:
        return list(self._layers)

    def position_source(self) -> PositionSource:
        # GPT2Model.forward: position_embeds = self.wpe(position_ids)
        return PositionSource(self.model.transformer.wpe, index=0)

    @property
    def hidden_size(self) -> int:
        return self._d
