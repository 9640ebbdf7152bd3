"""A decode step without Python per layer for LLaMA-family Hugging Face models.

:class:`FusedDecoder` wraps a ``LlamaForCausalLM``-shaped model (``llama``, ``mistral``,
``qwen2``, ``qwen3``, ``phi3``: RMSNorm pre-norms, rotary positions — partial where the
model's tables are narrower than a head —, grouped-query attention, a SiLU-gated MLP;
Phi-3's stacked ``qkv_proj`` and ``gate_up_proj`` as they are) — plain, converted by
:func:`structlm.convert_` or compressed by ``structlm share compress`` — and generates
with it: the prompt goes through the model's own forward (prefill), then every new token
is one call into the compiled ``LlamaDecodeStack`` (``ops/csrc/decode_llama.cpp``):
embedding row, every layer (norms, projections on the few-row kernel, rotary embedding,
cached attention, gated MLP), final norm and LM head, with the keys and values in caches
the step owns. A Hugging Face decode step dispatches ~40 small PyTorch ops per layer
from Python; this one crosses into C++ once per token.

Every projection becomes a sum of chains of bound weights: a dense matrix (read in place),
an algebra layer's typed copies (its type at each position from the conversion's
schedule, tabulated once), the factors of a low-rank or shared-basis layer (applied in
order, never multiplied out). Anything else is refused with the module's name
(:class:`UnsupportedModel`); callers fall back to ``model.generate``.

The step's weights are copies laid out in the order a step reads them, on transparent
huge pages where the kernel offers them (:class:`~structlm.ops.weight_arena.WeightArena`:
8% faster streaming here, at the cost of a second copy of the weights). The decoder
snapshots them when it is built and checks every parameter's
version before each ``generate``: a model changed since (training, ``load_state_dict``)
is bound again. Greedy decoding matches ``model.generate`` token for token (tests:
``tests/hf/test_fused_decode.py``); sampling applies temperature, top-k and top-p as
``transformers``' warpers do, drawing from torch's global generator.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from structlm.hf.adapters.modules import ConcatProjection
from structlm.nn import AlgebraLinear
from structlm.nn.factorized import LowRankLinear, OneSidedLinear, SharedBasisLinear
from structlm.ops import cpu_kernels
from structlm.ops.weight_arena import WeightArena

__all__ = ["FUSED_MODEL_TYPES", "FusedDecoder", "UnsupportedModel", "fused_decoder_or_none"]

FUSED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
"""``config.model_type`` values the fused step handles."""

_DEFAULT_CAPACITY = 1024


class UnsupportedModel(ValueError):
    """The model (or one of its modules) has a shape the fused decode step does not run."""


def _dense_rows(mod: Any, w: torch.Tensor, arena: WeightArena) -> Any:
    return mod.BoundRows(arena.place(w.detach().contiguous()),
                         *cpu_kernels.dense_tables(*w.shape), 1, -1)


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
        w = module.weight.detach()
        tables = cpu_kernels.block_tables(module.plan)
        rows = mod.BoundRows(arena.place(cpu_kernels.typed_weight(w, module.plan)), *tables,
                             module.q, slots.slot(module))
        return mod.ChainLinear([[rows]], bias)
    if isinstance(module, nn.Linear):  # DecodeLinear included
        return mod.ChainLinear([[_dense_rows(mod, module.weight, arena)]], bias)
    if isinstance(module, LowRankLinear):
        return mod.ChainLinear([[_dense_rows(mod, module.C, arena),
                                 _dense_rows(mod, module.B, arena)]], bias)
    if isinstance(module, OneSidedLinear):
        return mod.ChainLinear([[_dense_rows(mod, module.basis.P, arena),
                                 _dense_rows(mod, module.D, arena)]], bias)
    if isinstance(module, SharedBasisLinear):
        terms = [[_dense_rows(mod, module.basis.P, arena), _dense_rows(mod, module.core, arena),
                  _dense_rows(mod, module.basis.U, arena)]]
        if module.res_b is not None:
            terms.append([_dense_rows(mod, module.res_c, arena),
                          _dense_rows(mod, module.res_b, arena)])
        return mod.ChainLinear(terms, bias)
    raise UnsupportedModel(f"the fused decode step has no rule for {type(module).__name__} "
                           "(dense, algebra, low-rank, one-sided and shared-basis linears are "
                           "supported)")


def _is_silu(act: Any) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def _check_model(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FUSED_MODEL_TYPES:
        raise UnsupportedModel(f"model type {kind!r}: the fused decode step runs "
                               f"{', '.join(FUSED_MODEL_TYPES)}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {config.hidden_act!r}: the fused step's MLP "
                               "gate is SiLU")
    dtype = model.get_input_embeddings().weight.dtype
    if dtype not in (torch.float32, torch.float64):
        raise UnsupportedModel(f"dtype {dtype}: the fused step runs float32 and float64")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise UnsupportedModel("the fused decode step runs on the CPU")
    return config


def _attention_inputs(mod: Any, attn: nn.Module, slots: _Slots, arena: WeightArena
                      ) -> list[Any]:
    """``[q, k, v]``, or one stacked ``[q; k; v]`` (Phi-3's ``qkv_proj``; split into three
    modules when a conversion replaced them)."""
    qkv = getattr(attn, "qkv_proj", None)
    if qkv is None:
        return [_chain(mod, getattr(attn, n), slots, arena) for n in ("q_proj", "k_proj", "v_proj")]
    if isinstance(qkv, ConcatProjection):
        return [_chain(mod, part, slots, arena) for part in qkv.parts]
    return [_chain(mod, qkv, slots, arena)]


def _layer(mod: Any, block: nn.Module, slots: _Slots, arena: WeightArena) -> Any:
    attn, mlp = block.self_attn, block.mlp
    attn_in = _attention_inputs(mod, attn, slots, arena)
    if hasattr(mlp, "proj_in"):  # GatedMLP: one stacked [gate; up] projection
        if not _is_silu(mlp.act):
            raise UnsupportedModel(f"MLP activation {type(mlp.act).__name__}: expected SiLU")
        mlp_in, down = [_chain(mod, mlp.proj_in, slots, arena)], mlp.down
    elif hasattr(mlp, "gate_up_proj"):  # Phi-3: one stacked [gate; up] projection
        if not _is_silu(mlp.activation_fn):
            raise UnsupportedModel(f"MLP activation {type(mlp.activation_fn).__name__}: "
                                   "expected SiLU")
        mlp_in, down = [_chain(mod, mlp.gate_up_proj, slots, arena)], mlp.down_proj
    else:
        if not _is_silu(mlp.act_fn):
            raise UnsupportedModel(f"MLP activation {type(mlp.act_fn).__name__}: expected SiLU")
        mlp_in = [_chain(mod, mlp.gate_proj, slots, arena), _chain(mod, mlp.up_proj, slots, arena)]
        down = mlp.down_proj
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return mod.LlamaLayer(
        block.input_layernorm.weight.detach(), block.post_attention_layernorm.weight.detach(),
        attn_in, _chain(mod, attn.o_proj, slots, arena), mlp_in, _chain(mod, down, slots, arena),
        None if q_norm is None else q_norm.weight.detach(),
        None if k_norm is None else k_norm.weight.detach())


def _build_stack(model: nn.Module, capacity: int, arena: WeightArena) -> Any:
    """The compiled step; its weights placed in ``arena`` in the order a step reads them
    (layer by layer, the head last)."""
    mod = cpu_kernels.kernel_for(model.lm_head.weight, model.lm_head.weight)
    config = _check_model(model)
    inner = model.model
    slots = _Slots(capacity)
    layers = [_layer(mod, b, slots, arena) for b in inner.layers]
    head = _chain(mod, model.lm_head, slots, arena)
    eps = float(config.rms_norm_eps)
    for b in inner.layers:
        for norm in (b.input_layernorm, b.post_attention_layernorm):
            if float(getattr(norm, "variance_epsilon", eps)) != eps:
                raise UnsupportedModel("layer norms with different epsilons")
    attn = inner.layers[0].self_attn
    head_dim = int(attn.head_dim)
    n_heads = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
    embed = arena.place(model.get_input_embeddings().weight.detach().contiguous())
    with torch.no_grad():
        cos, sin = inner.rotary_emb(embed[:1], torch.arange(capacity)[None])  # (1, cap, rot)
    return mod.LlamaDecodeStack(
        embed, layers, inner.norm.weight.detach(), head, eps, n_heads, n_kv, head_dim,
        float(attn.scaling), cos[0].to(embed.dtype).contiguous(),
        sin[0].to(embed.dtype).contiguous(), slots.table())


def _cache_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s keys and values ``(B, KV, T, hd)`` from a ``transformers`` cache."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def _output_cache(out: Any) -> Any:
    """The cache a ``transformers`` forward returned (``cache``; ``past_key_values`` before
    transformers 5.x renamed it)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """``transformers``' temperature, top-k and top-p warpers, in that order (at least one
    token kept)."""
    scores = logits / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(1, sorted_idx, remove), -float("inf"))
    return scores


class FusedDecoder:
    """``model``'s generation with the fused decode step (see the module docstring).

    ``capacity``: the longest prompt + new tokens the caches hold at first; a longer
    ``generate`` rebinds with a capacity of the next power of two.

    Raises:
        UnsupportedModel: when the model's family, activation, dtype, device or one of its
            projections is not one the fused step runs.
        RuntimeError: when the CPU kernels are not available.
    """

    def __init__(self, model: nn.Module, capacity: int = _DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.model = model
        self.config = _check_model(model)
        window = getattr(self.config, "sliding_window", None)
        #: positions attention may span: the sliding window where the model has one in use
        self.window = (int(window) if window is not None
                       and getattr(self.config, "use_sliding_window", True) else None)
        self._capacity = capacity if self.window is None else min(capacity, self.window)
        self._bind()

    def _bind(self) -> None:
        self._versions = [(p, p._version) for p in self.model.parameters()]
        self.stack = None  # the old arena is freed before the new one is made
        arena = WeightArena()
        _build_stack(self.model, self._capacity, arena)  # counting pass: the arena's size
        arena.allocate()
        self.stack = _build_stack(self.model, self._capacity, arena)
        #: whether the weights lie on transparent huge pages (see structlm.ops.weight_arena)
        self.huge_pages = arena.huge_pages
        self.weight_bytes = arena.nbytes

    def _fresh(self, needed: int) -> None:
        """Rebinds when a parameter changed since binding or the caches are too short."""
        if self.window is not None and needed > self.window:
            raise UnsupportedModel(f"{needed} positions exceed the sliding-window attention's "
                                   f"window of {self.window}: the fused step attends to every "
                                   "cached position (no window)")
        if needed > self._capacity:
            self._capacity = 1 << (needed - 1).bit_length()
            self._bind()
        elif (len(self._versions) != len(list(self.model.parameters()))
              or any(p._version != v for p, v in self._versions)):
            self._bind()

    @property
    def generation_config(self) -> Any:
        return self.model.generation_config

    def prefill(self, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Runs the prompt ``(B, T)`` through the model (rebinding first if a parameter
        changed or ``T + new_tokens`` positions exceed the caches) and loads its keys and
        values; returns the last position's logits ``(B, V)``."""
        self._fresh(input_ids.shape[1] + new_tokens)
        return self._prefill(input_ids)

    def greedy_steps(self, token: torch.Tensor, pos: int, steps: int) -> torch.Tensor:
        """``steps`` greedy steps from ``token`` ``(B,)`` at position ``pos`` (after
        :meth:`prefill`); returns the ids produced ``(B, steps)``."""
        out = []
        for i in range(steps):
            token = self.stack.step(token, pos + i).argmax(dim=-1)
            out.append(token)
        return torch.stack(out, dim=1)

    def _prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Runs the prompt through the model, loads its keys and values; last logits."""
        with torch.no_grad():
            out = self.model(input_ids=input_ids, use_cache=True)
        self.stack.reset(input_ids.shape[0])
        for i in range(len(self.model.model.layers)):
            k, v = _cache_kv(_output_cache(out), i)
            self.stack.set_cache(i, k.contiguous(), v.contiguous())
        return out.logits[:, -1].float()

    def step(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        """Logits ``(B, V)`` of the tokens ``ids`` ``(B,)`` at position ``pos`` (after
        :meth:`generate`'s prefill or a previous step)."""
        return self.stack.step(ids, pos)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 *, max_new_tokens: int, do_sample: bool = False, eos_token_id: Any = "model",
                 pad_token_id: Any = None, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 50) -> torch.Tensor:
        """``input_ids`` ``(B, T)`` followed by the new ids, as ``model.generate`` returns.

        Greedy or sampled (temperature, top-k, top-p, from torch's global generator).
        ``eos_token_id``: ``"model"`` (the generation config's), ``None`` (no token stops:
        exactly ``max_new_tokens``) or ids; a sequence stops after emitting one (batch 1;
        a batch decodes a fixed number of tokens). Sequences are unpadded.
        """
        del pad_token_id
        if input_ids.ndim != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids (B, T) expected, got {tuple(input_ids.shape)}")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("the fused decode step takes unpadded prompts (an attention "
                             "mask of ones)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        stop = self.generation_config.eos_token_id if eos_token_id == "model" else eos_token_id
        stops = set(stop) if isinstance(stop, (list, tuple)) else {stop} - {None}
        if stops and input_ids.shape[0] > 1:
            raise ValueError("a batch decodes a fixed number of tokens: pass eos_token_id=None")
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        T = input_ids.shape[1]
        self._fresh(T + max_new_tokens)
        logits = self._prefill(input_ids)
        new: list[torch.Tensor] = []
        for i in range(max_new_tokens):
            if do_sample:
                probs = _warp(logits, temperature, top_k, top_p).softmax(dim=-1)
                nxt = torch.multinomial(probs, num_samples=1)[:, 0]
            else:
                nxt = logits.argmax(dim=-1)
            new.append(nxt)
            if (stops and int(nxt[0]) in stops) or i + 1 == max_new_tokens:
                break
            logits = self.stack.step(nxt, T + i)
        return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1)


def fused_decoder_or_none(model: nn.Module, capacity: int = _DEFAULT_CAPACITY
                          ) -> tuple[FusedDecoder | None, str]:
    """The model's :class:`FusedDecoder` and ``""``, or ``None`` and why not."""
    try:
        return FusedDecoder(model, capacity), ""
    except (UnsupportedModel, RuntimeError) as e:
        return None, str(e)
