"""The paper's decoder as a Hugging Face model, with ``AlgebraLinear`` SwiGLU FFNs.

Every dense projection (attention, LM head, a dense FFN) is a
:class:`~structlm.nn.DecodeLinear`: an ``nn.Linear`` whose CPU decode steps run on the
same compiled few-row kernel as the algebra layers, so a dense-vs-algebra decode
comparison measures the algebra, not a kernel difference.

Forwards that can take a fast path ask the route (:func:`structlm.ops.route.choose`): the
MLP whether its whole SwiGLU runs in one compiled call, the model whether a decode step
runs every block in one call (:mod:`.decode_step`, the one hook point of the CPU decode
accelerator). Nothing here imports a kernel module.

Position types come from *absolute* positions (``position_ids``) through the
config's schedule, identically in training, full or chunked prefill and cached
decoding; during decode only the new tokens' types are computed. The row sets of the
types are computed once per forward and shared by every FFN projection.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from structlm.algebra import get_algebra, is_dense, num_types, support_of
from structlm.models.configuration_structlm import StructLMConfig
from structlm.models.decode_step import BlockTensors, DecodeAccelerator
from structlm.models.kv_cache import GrowingKVCache, use_growing_layers
from structlm.models.saved_product import check_saved_product, write_saved_product
from structlm.nn import (
    AlgebraLinear,
    DecodeLinear,
    StructureTracked,
    get_schedule,
    invalidate_fast_paths,
    structure_epoch,
)
from structlm.nn.fused import swiglu_rows
from structlm.nn.structured_scores import score_groups, structured_attention
from structlm.ops.partition import TypePartition
from structlm.ops.route import AlgebraCall, FFNCall, Route, choose

__all__ = ["StructLMForCausalLM", "StructLMModel", "StructLMPreTrainedModel"]

#: the exact module types the compiled kernels take as a dense projection (``x W^T + b``
#: from ``weight`` and ``bias``); a subclass may compute something else
LINEAR_KINDS: frozenset[type[nn.Module]] = frozenset((nn.Linear, DecodeLinear))


def _is_dense(config: StructLMConfig) -> bool:
    return is_dense(config.algebra)


class StructLMLayerNorm(StructureTracked, nn.LayerNorm):
    """``nn.LayerNorm`` whose parameter replacements invalidate cached fast paths."""


#: the exact layer norm types the decode stack re-implements
NORM_KINDS: frozenset[type[nn.Module]] = frozenset((nn.LayerNorm, StructLMLayerNorm))


class _Blocks(StructureTracked, nn.ModuleList):
    """The decoder blocks (a ``ModuleList`` whose replacements invalidate fast paths)."""


class StructLMAttention(StructureTracked, nn.Module):
    """Multi-head causal self-attention with biased projections (dense)."""

    def __init__(self, config: StructLMConfig, layer_idx: int) -> None:
        super().__init__()
        self.n_head = config.num_attention_heads
        self.d_model = config.hidden_size
        self.layer_idx = layer_idx
        self.qkv = DecodeLinear(self.d_model, 3 * self.d_model, bias=True)
        self.proj = DecodeLinear(self.d_model, self.d_model, bias=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None,
                cache: DynamicCache | None,
                score_types: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """``score_types``: ``(query types (B, T), key types (B, S), groups (q, q, q))``
        for structured scores; ``None``: dense scores."""
        b, t, d = x.shape  # (B, T, D)
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
                   for z in (q, k, v))  # (B, nh, T, hs)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, nh, S, hs)
        if score_types is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, nh, T, hs)
        else:
            y = structured_attention(q, k, v, *score_types, mask=mask)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class StructLMMLP(StructureTracked, nn.Module):
    """Bias-free SwiGLU whose three projections follow the config's algebra."""

    def __init__(self, config: StructLMConfig) -> None:
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        if _is_dense(config):
            make = lambda i, o: DecodeLinear(i, o, bias=False)  # noqa: E731
        else:
            make = lambda i, o: AlgebraLinear(i, o, config.algebra, bias=False)  # noqa: E731
        self.gate, self.up, self.down = make(d, f), make(d, f), make(f, d)

    def kernel_kind(self) -> str | None:
        """Which SwiGLU kernel (``cpu_kernels.swiglu_rows``, and the FFN of the fused
        decode step) computes this MLP: ``"dense"`` for bias-free ``nn.Linear`` /
        ``DecodeLinear`` projections, ``"algebra"`` for bias-free ``AlgebraLinear`` s with
        gate and up of one algebra and widths (they share one plan there); shapes
        ``(F, D)``, ``(F, D)``, ``(D, F)`` either way. ``None`` for anything else (a
        projection replaced by another module): then only the modules' forward is right."""
        gate, up, down = self.gate, self.up, self.down
        kinds = {type(gate), type(up), type(down)}
        if kinds <= LINEAR_KINDS:
            kind = "dense"
        elif kinds == {AlgebraLinear} and (gate.algebra_name == up.algebra_name
                                           and gate.in_widths == up.in_widths
                                           and gate.out_widths == up.out_widths):
            kind = "algebra"
        else:
            return None
        f, d = gate.weight.shape
        if (gate.bias is not None or up.bias is not None or down.bias is not None
                or up.weight.shape != (f, d) or down.weight.shape != (d, f)
                or (gate.out_features, gate.in_features) != (f, d)
                or (up.out_features, up.in_features) != (f, d)
                or (down.out_features, down.in_features) != (d, f)):
            return None
        return kind

    def _cached_kernel_kind(self) -> str | None:
        """:meth:`kernel_kind`, remembered until the structure epoch changes
        (:func:`~structlm.nn.structure_epoch`: replacing a projection or its bias counts);
        a full check costs ~15 us, more than the decode call it guards."""
        epoch = structure_epoch()
        cached = self.__dict__.get("_kernel_kind_at")
        if cached is None or cached[0] != epoch:
            cached = (epoch, self.kernel_kind())
            self.__dict__["_kernel_kind_at"] = cached
        return cached[1]

    def forward(self, x: torch.Tensor, types: torch.Tensor | TypePartition | None
                ) -> torch.Tensor:
        if self._route(x, types) is Route.SWIGLU_KERNEL:  # a CPU decode step: one call
            plans = None if types is None else (self.gate.plan, self.down.plan)
            y2 = swiglu_rows(x.reshape(-1, x.shape[-1]), self.gate.weight, self.up.weight,
                             self.down.weight, plans, types)  # (M, D)
            return y2.view(x.shape)
        if types is None:  # dense
            return self.down(F.silu(self.gate(x)) * self.up(x))
        h = F.silu(self.gate(x, types)) * self.up(x, types)  # (B, T, F)
        return self.down(h, types)  # (B, T, D)

    def _route(self, x: torch.Tensor, types: torch.Tensor | TypePartition | None) -> Route:
        """The route of this FFN call (:class:`~structlm.ops.route.FFNCall`)."""
        kind = self._cached_kernel_kind()
        part = types if type(types) is TypePartition else None
        if kind == "algebra" and types is not None and part is None:
            kind = None  # device types (no host partition): the modules' forward
        if kind is None:
            return choose(FFNCall(x, None, None)).route
        gate, up, down = self.gate, self.up, self.down
        projections = () if kind != "algebra" else tuple(
            (m.weight, m.plan, m.backend) for m in (gate, up, down))
        return choose(FFNCall(x, kind, (gate.weight, up.weight, down.weight), part,
                              projections)).route

    def kernel_ready(self, x: torch.Tensor, q: int | None) -> bool:
        """Whether the decode stack can compute this FFN for inputs like ``x``: its
        structure (:meth:`kernel_kind`: dense for a model without types, algebra of the
        model's ``q`` otherwise) and, for algebra projections, the route taking the kernel
        for a row of them."""
        kind = self.kernel_kind()
        if kind is None or (kind == "algebra") != (q is not None):
            return False
        if kind == "dense":
            return True
        one = TypePartition(torch.zeros(1, dtype=torch.int64), self.gate.q)
        return self.gate.q == q and all(
            choose(AlgebraCall(x.new_empty(1, m.in_features), m.weight, m.plan, one,
                               m.backend)).route is Route.KERNEL
            for m in (self.gate, self.up, self.down))


class StructLMBlock(StructureTracked, nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: StructLMConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = StructLMLayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = StructLMAttention(config, layer_idx)
        self.ln_2 = StructLMLayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = StructLMMLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cache: DynamicCache | None,
                types: torch.Tensor | TypePartition | None,
                score_types: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask, cache, score_types)  # (B, T, D)
        return x + self.mlp(self.ln_2(x), types)  # (B, T, D)

    def kernel_tensors(self, x: torch.Tensor, n_head: int, q: int | None) -> BlockTensors | None:
        """This block's tensors as the decode stack takes them, or ``None`` where the block
        is not exactly what the kernel computes for inputs like ``x``.

        That is ``StructLMLayerNorm`` s (affine, with bias, one eps), the
        ``StructLMAttention`` with ``nn.Linear`` (or ``DecodeLinear``) qkv ``(3D, D)`` and
        proj ``(D, D)``, both with bias, and the ``StructLMMLP`` whose projections the
        SwiGLU kernel takes (:meth:`StructLMMLP.kernel_ready`: bias-free dense layers for a
        model without position types, algebra layers of the model's ``q`` on the kernel
        route otherwise), every parameter of ``x``'s dtype, on the CPU, contiguous.
        Anything else — a replaced matrix (``ConcatProjection``, ``LowRankLinear`` ...), a
        ``GatedMLP``, a bias-free projection — sends the model to the modules' forward."""
        d = x.shape[-1]
        ln1, ln2, attn, mlp = self.ln_1, self.ln_2, self.attn, self.mlp
        if not (type(ln1) in NORM_KINDS and type(ln2) in NORM_KINDS
                and ln1.normalized_shape == ln2.normalized_shape == (d,)
                and ln1.elementwise_affine and ln2.elementwise_affine
                and ln1.bias is not None and ln2.bias is not None and ln1.eps == ln2.eps):
            return None
        if not (type(attn) is StructLMAttention and attn.n_head == n_head and d % n_head == 0):
            return None
        qkv, proj = attn.qkv, attn.proj
        if not (type(qkv) in LINEAR_KINDS and type(proj) in LINEAR_KINDS
                and qkv.weight.shape == (3 * d, d) and qkv.bias is not None
                and qkv.bias.shape == (3 * d,) and proj.weight.shape == (d, d)
                and proj.bias is not None and proj.bias.shape == (d,)):
            return None
        if not (type(mlp) is StructLMMLP and mlp.gate.in_features == d
                and mlp.kernel_ready(x, q)):
            return None
        dense = [ln1.weight, ln1.bias, qkv.weight, qkv.bias, proj.weight, proj.bias,
                 ln2.weight, ln2.bias]
        ffn = (mlp.gate.weight, mlp.up.weight, mlp.down.weight)
        if not all(p.dtype == x.dtype and p.device.type == "cpu" and p.is_contiguous()
                   for p in (*dense, *ffn)):
            return None
        plans = None if q is None else (mlp.gate.plan, mlp.down.plan)
        return BlockTensors(dense, ffn, plans, float(ln1.eps))


class StructLMPreTrainedModel(StructureTracked, PreTrainedModel):
    """Weight initialisation and the Hugging Face plumbing."""

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False
                        ) -> Any:
        """``nn.Module.load_state_dict``; the fast paths' cached decisions are rebuilt
        (with ``assign=True`` the parameters are new objects)."""
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)
        invalidate_fast_paths(self)
        return out

    config_class = StructLMConfig
    base_model_prefix = "transformer"

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        """``PreTrainedModel.save_pretrained``, plus the product the weights compute
        (:mod:`structlm.models.saved_product`)."""
        out = super().save_pretrained(save_directory, *args, **kwargs)
        write_saved_product(save_directory, self.config)
        return out

    @classmethod
    def from_pretrained(cls, path: Any, *args: Any, **kwargs: Any) -> Any:
        """``PreTrainedModel.from_pretrained``; a local folder whose ``config.json``
        disagrees with the product its weights were saved for is refused."""
        out = super().from_pretrained(path, *args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        if os.path.isdir(str(path)):
            check_saved_product(path, model.config)
        return out
    _no_split_modules: ClassVar[list[str]] = ["StructLMBlock"]
    _supports_sdpa = True

    @property
    def device(self) -> torch.device:
        """The token embedding's device, in O(1) (``PreTrainedModel.device`` walks the
        parameters, which ``generate`` does twice per token)."""
        try:
            return self.get_input_embeddings().weight.device
        except (AttributeError, NotImplementedError):  # not built yet
            return super().device

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear | AlgebraLinear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if (isinstance(module, AlgebraLinear)
                    and getattr(self.config, "algebra_init", "dense") == "variance-matched"):
                with torch.no_grad():  # (N, K) rows scaled by 1/sqrt(input fraction seen)
                    module.weight.mul_(module.input_fraction().rsqrt()[:, None].to(
                        module.weight.dtype))
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


class StructLMModel(StructLMPreTrainedModel):
    """Embeddings, blocks and the final LayerNorm."""

    def __init__(self, config: StructLMConfig) -> None:
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.n_positions, config.hidden_size)
        self.h = _Blocks([StructLMBlock(config, i) for i in range(config.num_hidden_layers)])
        self.ln_f = StructLMLayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.q = num_types(config.algebra)
        self.schedule = None if _is_dense(config) else get_schedule(config.type_schedule, self.q)
        self.score_groups = (score_groups(support_of(get_algebra(config.algebra)).mask)
                             if getattr(config, "structured_scores", False) else None)
        self.decode_accelerator = DecodeAccelerator()
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.wte = value

    def position_types(self, position_ids: torch.Tensor, layer: int = 0
                       ) -> torch.Tensor | TypePartition | None:
        """FFN types of absolute positions ``(B, T)`` in decoder layer ``layer``; on the
        CPU already as row sets."""
        if self.schedule is None:
            return None
        types = self.schedule.at_layer(layer)(position_ids)
        if types.device.type == "cpu":
            return TypePartition(types.reshape(-1), self.q)
        return types

    def _layer_types(self, position_ids: torch.Tensor, key_positions: torch.Tensor | None
                     ) -> list[tuple[Any, Any]]:
        """Per decoder layer: (FFN types, structured-score types or ``None``); computed
        once per distinct layer schedule (one, or q for a cross-layer schedule)."""
        memo: dict[int, tuple[Any, Any]] = {}
        out = []
        for i in range(len(self.h)):
            key = i % self.q if self.schedule is not None and self.schedule.depends_on_layer else 0
            if key not in memo:
                score = None
                if self.score_groups is not None:
                    assert self.schedule is not None and key_positions is not None
                    sched = self.schedule.at_layer(i)
                    score = (sched(position_ids), sched(key_positions), self.score_groups)
                memo[key] = (self.position_types(position_ids, i), score)
            out.append(memo[key])
        return out

    def _key_positions(self, position_ids: torch.Tensor, cache: DynamicCache | None,
                       past: int) -> torch.Tensor | None:
        """Absolute positions ``(B, S)`` of every key (structured scores need the types of
        cached keys); kept on the cache beside the keys."""
        if self.score_groups is None:
            return None
        if cache is None:
            return position_ids
        if past == 0:
            keys = position_ids
        else:
            held = getattr(cache, "_structlm_key_positions", None)
            if held is None or held.shape[-1] < past or held.shape[0] != position_ids.shape[0]:
                raise ValueError("structured attention scores need the positions of the "
                                 "cached keys: continue with a cache this model filled "
                                 f"({past} cached keys, positions of "
                                 f"{None if held is None else tuple(held.shape)} held)")
            keys = torch.cat([held[:, :past], position_ids], dim=1)  # a crop drops the tail
        cache._structlm_key_positions = keys  # type: ignore[union-attr]
        return keys

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: DynamicCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)  # transformers < 5 name
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if (input_ids is not None and input_ids.device.type == "cpu" and input_ids.numel()
                and not torch.compiler.is_compiling()):
            top = int(input_ids.max())
            if top >= self.config.vocab_size:
                raise ValueError(f"token id {top} is outside the vocabulary "
                                 f"(vocab_size={self.config.vocab_size}): tokenizer and model "
                                 "do not match")
        x = self.wte(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, D)
        b, t = x.shape[:2]
        if use_cache and cache is None:
            cache = GrowingKVCache()
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=x.device).expand(b, t)
        if x.device.type == "cpu" and position_ids.numel() and not torch.compiler.is_compiling():
            top = int(position_ids.max())
            if top >= self.config.n_positions:
                raise ValueError(f"position {top} is beyond the context "
                                 f"n_positions={self.config.n_positions}")
        x = x + self.wpe(position_ids)
        mask = self._attention_mask(attention_mask, b, t, past, x.device)  # (B, 1, T, S) | None
        y = self.decode_accelerator.step(self, x, mask, position_ids, cache)  # (B, 1, D)
        if y is not None:  # the route chose the decode stack: every block in one call
            x = y
        else:
            position_ids = position_ids.expand(b, t)
            keys = self._key_positions(position_ids, cache, past)  # (B, S) | None
            for block, (types, score_types) in zip(self.h, self._layer_types(position_ids, keys),
                                                   strict=True):
                x = block(x, mask, cache, types, score_types)  # (B, T, D)
        return BaseModelOutputWithPast(last_hidden_state=self.ln_f(x), cache=cache)

    @staticmethod
    def _attention_mask(attention_mask: torch.Tensor | None, b: int, t: int, past: int,
                        device: torch.device) -> torch.Tensor | None:
        """Boolean ``(B, 1, T, past + T)``: causal over cache order, minus padding; a
        query always sees itself (fully padded rows stay finite). ``None`` for one new
        token without padding (it sees every key; SDPA skips the mask)."""
        s = past + t
        if t == 1 and (attention_mask is None or (
                device.type == "cpu" and not torch.compiler.is_compiling()
                and bool(attention_mask[:, -s:].all()))):
            return None
        qpos = torch.arange(past, s, device=device)[:, None]
        kpos = torch.arange(s, device=device)[None, :]
        mask = (kpos <= qpos).expand(b, 1, t, s)
        if attention_mask is not None:
            keep = attention_mask[:, -s:].to(torch.bool)[:, None, None, :]
            mask = (mask & keep) | (kpos == qpos)
        return mask


class StructLMForCausalLM(StructLMPreTrainedModel, GenerationMixin):
    """Causal LM head (tied to the token embedding)."""

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: StructLMConfig) -> None:
        super().__init__(config)
        self.transformer = StructLMModel(config)
        self.lm_head = DecodeLinear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.transformer.wte = value

    def _prepare_cache_for_generation(self, generation_config: Any, model_kwargs: dict,
                                      *args: Any, **kwargs: Any) -> Any:
        """``generate``'s default ``DynamicCache``, with layers that append in place
        (:mod:`.kv_cache`); a cache the caller passes is used as given."""
        out = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args,
                                                    **kwargs)
        if model_kwargs.get("cache") is not None:
            use_growing_layers(model_kwargs["cache"])
        return out

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: DynamicCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        out = self.transformer(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, cache=cache,
                               inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        h = out.last_hidden_state
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                   labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache)
