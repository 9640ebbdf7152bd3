"""LLaMA family: separate ``q/k/v/o_proj`` (K and V narrower under grouped-query or
multi-query attention), a gated MLP ``down(act(gate(x)) * up(x))`` whose MLP-in is the
stacked ``[gate; up]``, rotary positions. The decoders that keep these module names:

* ``llama`` (SmolLM2, TinyLlama), ``mistral``, ``qwen2``;
* ``qwen3`` — RMSNorms on each head's query and key *after* the projections: a matrix's
  input is still the pre-norm output;
* ``olmo2`` — no pre-norms: norms *after* attention and after the MLP (before the
  residual add) and q/k norms after the projections, so Q/K/V and gate/up read the raw
  residual stream, O and down read the usual inputs, and their outputs are normalised
  before the residual (compression error on O and down passes through that norm);
* ``gemma2``, ``gemma3_text`` and the text part of ``gemma3`` — pre- *and* post-norms
  around attention and MLP (RMSNorm with a ``1 + w`` weight), q/k norms (Gemma 3),
  ``head_dim`` unrelated to ``hidden / heads``, usually one KV head (multi-query: K and V
  are tiny), sliding-window and global layers interleaved (the same matrices), a
  GELU-tanh gate, scaled embeddings, tied head, logit soft-capping (Gemma 2). The inputs
  of Q/K/V and gate/up are the pre-norm outputs; O's and down's outputs are normalised by
  the post-norm before the residual add.

None of these differences changes what a matrix's *input* is for calibration (the hook
reads each projection's actual input); they change how an output error reaches the
residual stream (:data:`FAMILY_NOTES`, quoted in the reports)."""

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
from structlm.hf.adapters.modules import GatedMLP, stacked, weight_and_bias

__all__ = ["FAMILY_NOTES", "LlamaAdapter"]

FAMILY_NOTES = {
    "qwen3": "q/k RMSNorm after the Q and K projections",
    "olmo2": "no pre-norms: Q/K/V and gate/up read the raw residual stream; O and down "
             "outputs pass a post-norm before the residual add; q/k norms",
    "gemma2": "pre- and post-norms (O and down outputs normalised before the residual "
              "add); multi-query K/V are tiny; head_dim unrelated to hidden/heads; "
              "GELU-tanh gate; logit soft-capping",
    "gemma3_text": "pre- and post-norms (O and down outputs normalised before the residual "
                   "add); q/k norms; multi-query K/V are tiny; head_dim unrelated to "
                   "hidden/heads; sliding-window and global layers",
}
FAMILY_NOTES["gemma3"] = FAMILY_NOTES["gemma3_text"] + " (the text decoder of Gemma 3)"

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

    def _replace(self, t: MatrixType, module: nn.Module) -> None:
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
    model_types = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma2", "gemma3_text",
                   "gemma3")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        inner = model.model
        self.decoder = getattr(inner, "language_model", inner)  # Gemma 3: its text part
        self.text_config = getattr(model.config, "text_config", None) or model.config
        self._layers = [LlamaLayerAdapter(i, b) for i, b in enumerate(self.decoder.layers)]
        self.notes = FAMILY_NOTES.get(model.config.model_type, "")

    @classmethod
    def handles(cls, model: nn.Module) -> bool:
        return getattr(getattr(model, "config", None), "model_type", None) in cls.model_types

    @property
    def layers(self) -> list[LayerAdapter]:
        return list(self._layers)

    def position_source(self) -> PositionSource:
        # LlamaModel.forward: self.rotary_emb(hidden_states, position_ids=position_ids);
        # Gemma 2/3, Qwen3: self.rotary_emb(hidden_states, position_ids[, layer_type])
        return PositionSource(self.decoder.rotary_emb, keyword="position_ids", index=1)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)
