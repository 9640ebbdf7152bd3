"""A Hugging Face decoder as the compiled decode step's ``DecodeStack``
(``ops/csrc/decode_hf.cpp``): which families it runs, and how each module becomes bound
weights.

Families: the LLaMA family (``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``phi3``: RMSNorm
pre-norms, rotary positions — partial where the model's tables are narrower than a head
—, grouped-query attention, a SiLU-gated MLP; Qwen3's per-head q/k norms; Phi-3's stacked
``qkv_proj`` and ``gate_up_proj``), ``olmo2`` (no pre-norms: RMSNorms after attention and
MLP, before the residual add; full-width q/k norms), ``gemma2`` and ``gemma3_text``
(pre- and post-norms scaling by ``1 + w``, a scaled embedding, a GELU-tanh gate,
soft-capped attention and final logits, Gemma 3's per-head q/k norms and local / global
rotary tables; sliding-window layers only up to their window) and ``gpt2`` (LayerNorm with biases,
learned positions, a GELU MLP, ``Conv1D`` weights stored transposed). Every projection
becomes a sum of chains of bound weights: a dense matrix, an algebra layer's typed copy
(its type at each position tabulated once from the conversion's schedule), the factors of
a low-rank or shared-basis layer (applied in order, never multiplied out); sibling
projections of one input (q, k, v; gate, up) of one kind run as one chain
(:mod:`structlm.hf.fused_siblings`); anything else is refused with the module's name
(:class:`UnsupportedModel`). The weights are placed in a
:class:`~structlm.ops.weight_arena.WeightArena` in the order a step reads them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from structlm.hf.adapters.modules import ConcatProjection
from structlm.hf.fused_siblings import Firsts, dense_rows, siblings
from structlm.nn import AlgebraLinear
from structlm.nn.factorized import LowRankLinear, OneSidedLinear, SharedBasisLinear
from structlm.ops import cpu_kernels
from structlm.ops.weight_arena import WeightArena

__all__ = ["FUSED_MODEL_TYPES", "UnsupportedModel", "build_stack", "check_model",
           "decoder_layers", "position_limit"]

_LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "phi3")
_GEMMA = ("gemma2", "gemma3_text")
FUSED_MODEL_TYPES = (*_LLAMA_FAMILY, "olmo2", *_GEMMA, "gpt2")
"""``config.model_type`` values the fused step handles."""

#: GPT-2's ``activation_function`` -> the step's MLP activation
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                     "gelu": "gelu"}


class UnsupportedModel(ValueError):
    """The model (or one of its modules) has a shape the fused decode step does not run."""


class _Slots:
    """The distinct position-type schedules of a model's algebra layers: each gets a
    column of the step's type table (keyed on its types at every position)."""

    def __init__(self, capacity: int) -> None:
        self.positions = torch.arange(capacity)
        self.columns: list[torch.Tensor] = []
        self._index: dict[bytes, int] = {}

    def slot(self, layer: AlgebraLinear) -> int:
        source = getattr(layer, "position_types", None)
        index = getattr(layer, "layer_index", None)
        if source is None or index is None:
            raise UnsupportedModel(
                f"an {type(layer).__name__} without a position-type source: only layers "
                "converted by structlm.convert_ (TypedAlgebraLinear) read their types from "
                "the model's positions")
        types = source.schedule.at_layer(index)(self.positions).to(torch.int64)
        key = types.numpy().tobytes()
        if key not in self._index:
            self._index[key] = len(self.columns)
            self.columns.append(types)
        return self._index[key]

    def table(self) -> torch.Tensor:
        """``(capacity, slots)`` int64 (one zero column when no layer has types)."""
        if not self.columns:
            return torch.zeros(len(self.positions), 1, dtype=torch.int64)
        return torch.stack(self.columns, dim=1).contiguous()


def _chain(mod: Any, module: nn.Module, slots: _Slots, arena: WeightArena) -> Any:
    """The module as a ``ChainLinear`` (sum of chains of bound weights, plus its bias),
    its weights placed in ``arena``."""
    bias = getattr(module, "bias", None)
    bias = None if bias is None else bias.detach().contiguous()
    if isinstance(module, AlgebraLinear):
        # a detached view: the typed copy made from it is placed (copied) in the arena and
        # then freed, not cached against the parameter, which would keep a second copy of
        # every converted weight alive for the model's life
        w = module.weight.detach()
        tables = cpu_kernels.block_tables(module.plan)
        rows = mod.BoundRows(arena.place(cpu_kernels.typed_weight(w, module.plan)), *tables,
                             module.q, slots.slot(module))
        return mod.ChainLinear([[rows]], bias)
    if isinstance(module, nn.Linear):  # DecodeLinear included
        return mod.ChainLinear([[dense_rows(mod, module.weight, arena)]], bias)
    if type(module).__name__ == "Conv1D":  # GPT-2: (in, out) stored; the step reads (out, in)
        return mod.ChainLinear([[dense_rows(mod, module.weight.t(), arena)]], bias)
    if isinstance(module, LowRankLinear):
        return mod.ChainLinear([[dense_rows(mod, module.C, arena),
                                 dense_rows(mod, module.B, arena)]], bias)
    if isinstance(module, OneSidedLinear):
        return mod.ChainLinear([[dense_rows(mod, module.basis.P, arena),
                                 dense_rows(mod, module.D, arena)]], bias)
    if isinstance(module, SharedBasisLinear):
        terms = [[dense_rows(mod, module.basis.P, arena), dense_rows(mod, module.core, arena),
                  dense_rows(mod, module.basis.U, arena)]]
        if module.res_b is not None:
            terms.append([dense_rows(mod, module.res_c, arena),
                          dense_rows(mod, module.res_b, arena)])
        return mod.ChainLinear(terms, bias)
    raise UnsupportedModel(f"the fused decode step has no rule for {type(module).__name__} "
                           "(dense, algebra, low-rank, one-sided and shared-basis linears are "
                           "supported)")


def _is_silu(act: Any) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def check_model(model: nn.Module) -> Any:
    """The model's config after checking that the step runs it (family, activation,
    dtype, device); raises :class:`UnsupportedModel` naming what it does not run."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FUSED_MODEL_TYPES:
        raise UnsupportedModel(f"model type {kind!r}: the fused decode step runs "
                               f"{', '.join(FUSED_MODEL_TYPES)}")
    if kind == "gpt2":
        if config.activation_function not in _GPT2_ACTIVATIONS:
            raise UnsupportedModel(f"activation_function {config.activation_function!r}: "
                                   f"the fused step runs {sorted(_GPT2_ACTIVATIONS)}")
    elif kind in _GEMMA:
        if config.hidden_activation != "gelu_pytorch_tanh":
            raise UnsupportedModel(f"hidden_activation {config.hidden_activation!r}: the "
                                   "fused step's Gemma MLP gate is gelu_pytorch_tanh")
    elif getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {config.hidden_act!r}: the fused step's MLP "
                               "gate is SiLU")
    dtype = model.get_input_embeddings().weight.dtype
    if dtype not in (torch.float32, torch.float64):
        raise UnsupportedModel(f"dtype {dtype}: the fused step runs float32 and float64")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise UnsupportedModel("the fused decode step runs on the CPU")
    return config


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder blocks."""
    return model.transformer.h if model.config.model_type == "gpt2" else model.model.layers


def position_limit(model: nn.Module) -> int | None:
    """The most positions the step can hold: GPT-2's learned position table; else none."""
    return int(model.config.n_positions) if model.config.model_type == "gpt2" else None


def _weight(module: nn.Module | None) -> torch.Tensor | None:
    return None if module is None else module.weight.detach()


def _gemma_norm(module: nn.Module | None) -> torch.Tensor | None:
    """A Gemma RMSNorm's effective weight: it scales by ``1 + weight``."""
    return None if module is None else (1.0 + module.weight.detach()).contiguous()


def _bias(module: nn.Module | None) -> torch.Tensor | None:
    b = None if module is None else getattr(module, "bias", None)
    return None if b is None else b.detach()


def _inputs(mod: Any, parts: list[nn.Module], slots: _Slots, arena: WeightArena,
            firsts: Firsts) -> list[Any]:
    """Sibling projections of one input as one stacked chain where they stack
    (:func:`~structlm.hf.fused_siblings.siblings`), else one chain each."""
    stacked = siblings(mod, parts, slots, firsts, arena)
    if stacked is not None:
        return [stacked]
    return [_chain(mod, part, slots, arena) for part in parts]


def _attention_inputs(mod: Any, attn: nn.Module, slots: _Slots, arena: WeightArena,
                      firsts: Firsts) -> list[Any]:
    """``[q, k, v]``, or one stacked ``[q; k; v]`` (Phi-3's ``qkv_proj``, GPT-2's
    ``c_attn``; split into three modules when a conversion replaced them; compressed
    siblings of one kind as one chain, :func:`~structlm.hf.fused_siblings.siblings`)."""
    qkv = getattr(attn, "qkv_proj", None) or getattr(attn, "c_attn", None)
    parts = ([getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")] if qkv is None
             else list(qkv.parts) if isinstance(qkv, ConcatProjection) else [qkv])
    return _inputs(mod, parts, slots, arena, firsts)


def _gated_mlp(mod: Any, mlp: nn.Module, slots: _Slots, arena: WeightArena, firsts: Firsts,
               gelu: bool = False) -> tuple[list[Any], Any]:
    """``([gate, up] or [stacked gate; up], down)`` of a SiLU-gated MLP (GELU-tanh-gated
    with ``gelu``: Gemma)."""
    if hasattr(mlp, "proj_in"):  # GatedMLP (a compressed model): stacked [gate; up]
        act, down = mlp.act, mlp.down
        if isinstance(mlp.proj_in, ConcatProjection):  # [gate, up] as two modules
            if len(mlp.proj_in.parts) != 2:
                raise UnsupportedModel(f"an MLP input of {len(mlp.proj_in.parts)} parts: "
                                       "expected gate and up")
            mlp_in = _inputs(mod, list(mlp.proj_in.parts), slots, arena, firsts)
        else:
            mlp_in = [_chain(mod, mlp.proj_in, slots, arena)]
    elif hasattr(mlp, "gate_up_proj"):  # Phi-3: stacked [gate; up]
        act, mlp_in = mlp.activation_fn, [_chain(mod, mlp.gate_up_proj, slots, arena)]
        down = mlp.down_proj
    else:
        act, down = mlp.act_fn, mlp.down_proj
        mlp_in = _inputs(mod, [mlp.gate_proj, mlp.up_proj], slots, arena, firsts)
    if gelu and "Tanh" not in type(act).__name__:
        raise UnsupportedModel(f"MLP activation {type(act).__name__}: expected GELU-tanh")
    if not gelu and not _is_silu(act):
        raise UnsupportedModel(f"MLP activation {type(act).__name__}: expected SiLU")
    return mlp_in, _chain(mod, down, slots, arena)


def _layer(mod: Any, kind: str, block: nn.Module, slots: _Slots, arena: WeightArena,
           firsts: Firsts, rope: int = 0) -> Any:
    """One block as the step's ``DecoderLayer`` (``rope``: its rotary table)."""
    if kind == "gpt2":
        attn = block.attn
        attn_in = _attention_inputs(mod, attn, slots, arena, firsts)
        o = _chain(mod, attn.c_proj, slots, arena)
        mlp_in, down = [_chain(mod, block.mlp.c_fc, slots, arena)], block.mlp.c_proj
        return mod.DecoderLayer(
            _weight(block.ln_1), _bias(block.ln_1), _weight(block.ln_2), _bias(block.ln_2),
            None, None, attn_in, o, mlp_in, _chain(mod, down, slots, arena), None, None,
            float(attn.scaling))
    attn = block.self_attn
    attn_in = _attention_inputs(mod, attn, slots, arena, firsts)
    o = _chain(mod, attn.o_proj, slots, arena)
    mlp_in, down = _gated_mlp(mod, block.mlp, slots, arena, firsts, gelu=kind in _GEMMA)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if kind in _GEMMA:  # norms before and after attention and MLP, all scaling by 1 + w
        return mod.DecoderLayer(
            _gemma_norm(block.input_layernorm), None, _gemma_norm(block.pre_feedforward_layernorm),
            None, _gemma_norm(block.post_attention_layernorm),
            _gemma_norm(block.post_feedforward_layernorm), attn_in, o, mlp_in, down,
            _gemma_norm(q_norm), _gemma_norm(k_norm), float(attn.scaling), rope)
    if kind == "olmo2":  # norms after attention and MLP, none before
        pre = (None, None, None, None)
        post = (_weight(block.post_attention_layernorm),
                _weight(block.post_feedforward_layernorm))
    else:
        pre = (_weight(block.input_layernorm), None, _weight(block.post_attention_layernorm),
               None)
        post = (None, None)
    return mod.DecoderLayer(*pre, *post, attn_in, o, mlp_in, down, _weight(q_norm),
                            _weight(k_norm), float(attn.scaling))


def _norm_eps(model: nn.Module, config: Any) -> float:
    """The one epsilon of every norm (refused where they differ)."""
    eps = float(config.layer_norm_epsilon if config.model_type == "gpt2"
                else config.rms_norm_eps)
    for m in model.modules():
        e = getattr(m, "variance_epsilon", None)
        e = getattr(m, "eps", e) if e is None else e
        if e is not None and isinstance(e, float) and e != eps:
            raise UnsupportedModel(f"norms with different epsilons ({e} and {eps})")
    return eps


#: rotary types whose frequencies depend on the longest position of the call: a decode
#: step's (one position) differ from a table computed over all positions at once
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rotary_tables(rotary: nn.Module, embed: torch.Tensor, capacity: int,
                   layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``(capacity, rot)`` from the model's own rotary module (its scaling
    included), on a copy so that the model's state is left as it was. Length-dependent
    types (dynamic NTK, LongRoPE) are evaluated one position at a time, in order, as a
    decode step calls them; the rest over all positions at once."""
    rotary = copy.deepcopy(rotary)
    args = () if layer_type is None else (layer_type,)
    with torch.no_grad():
        if getattr(rotary, "rope_type", "default") in _LENGTH_DEPENDENT_ROPE:
            rows = [rotary(embed[:1], torch.tensor([[p]]), *args) for p in range(capacity)]
            c, s = torch.cat([r[0][0] for r in rows]), torch.cat([r[1][0] for r in rows])
        else:
            c, s = (r[0] for r in rotary(embed[:1], torch.arange(capacity)[None], *args))
    return c.to(embed.dtype).contiguous(), s.to(embed.dtype).contiguous()


def build_stack(model: nn.Module, capacity: int, arena: WeightArena) -> Any:
    """The compiled step for ``capacity`` positions; its weights placed in ``arena`` in
    the order a step reads them (layer by layer, the head last)."""
    config = check_model(model)
    kind = config.model_type
    head_module = model.lm_head
    mod = cpu_kernels.kernel_for(head_module.weight, head_module.weight)
    slots = _Slots(capacity)
    # the rotary tables: one, or one per layer type (Gemma 3: local and global)
    layer_types = list(getattr(config, "layer_types", None) or []) if kind == "gemma3_text" else []
    tables = sorted(set(layer_types)) or [None]
    ropes = [tables.index(lt) for lt in layer_types] or [0] * len(decoder_layers(model))
    firsts = Firsts()
    layers = [_layer(mod, kind, b, slots, arena, firsts, rope)
              for b, rope in zip(decoder_layers(model), ropes, strict=True)]
    head = _chain(mod, head_module, slots, arena)
    eps = _norm_eps(model, config)
    embeddings = model.get_input_embeddings()
    embed = arena.place(embeddings.weight.detach().contiguous())
    embed_scale = float(getattr(embeddings, "embed_scale", 1.0))  # Gemma: sqrt(hidden)
    if kind == "gpt2":
        n_heads = n_kv = int(config.n_head)
        head_dim = int(config.n_embd) // n_heads
        final, pos_embed = model.transformer.ln_f, model.transformer.wpe.weight.detach()
        cos = sin = [embed.new_zeros(capacity, 0)]  # no rotary positions
        act, gated = _GPT2_ACTIVATIONS[config.activation_function], False
    else:
        attn = decoder_layers(model)[0].self_attn
        head_dim = int(attn.head_dim)
        n_heads = int(config.num_attention_heads)
        n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
        final, pos_embed = model.model.norm, None
        cos, sin = [], []
        for lt in tables:
            c, s = _rotary_tables(model.model.rotary_emb, embed, capacity, lt)
            cos.append(c)
            sin.append(s)
        act, gated = ("gelu_tanh" if kind in _GEMMA else "silu"), True
    final_w = _gemma_norm(final) if kind in _GEMMA else _weight(final)
    return mod.DecodeStack(
        embed, embed_scale, pos_embed, layers, final_w, _bias(final), head, eps,
        kind == "gpt2", n_heads, n_kv, head_dim, act, gated,
        float(getattr(config, "attn_logit_softcapping", None) or 0.0),
        float(getattr(config, "final_logit_softcapping", None) or 0.0), cos, sin,
        slots.table())
