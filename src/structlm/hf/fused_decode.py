"""A decode step without Python per layer for Hugging Face decoders.

:class:`FusedDecoder` wraps a Hugging Face decoder the compiled step runs
(:mod:`structlm.hf.fused_stack`: the LLaMA family with Qwen3 and Phi-3, OLMo 2, Gemma 2/3,
GPT-2) —
plain, converted by :func:`structlm.convert_` or compressed by ``structlm share
compress`` — and generates with it: the prompt goes through the model's own forward
(prefill), then every new token is one call into the compiled ``DecodeStack``
(``ops/csrc/decode_hf.cpp``): embedding row, every layer (norms, projections on the
few-row kernel, rotary embedding, cached attention, MLP), final norm and LM head, with the
keys and values in caches the step owns. A Hugging Face decode step dispatches ~40 small
PyTorch ops per layer from Python; this one crosses into C++ once per token. A family or
module the step does not run is refused (:class:`UnsupportedModel`); callers fall back to
``model.generate``.

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

from structlm.hf.decode import output_cache
from structlm.hf.fused_stack import (
    FUSED_MODEL_TYPES,
    UnsupportedModel,
    build_stack,
    check_model,
    decoder_layers,
    position_limit,
)
from structlm.ops.weight_arena import WeightArena

__all__ = ["FUSED_MODEL_TYPES", "FusedDecoder", "UnsupportedModel", "fused_decoder_or_none",
           "fused_decoders"]

#: generation-config settings whose logits processors the fused generate does not apply,
#: with the value at which each does nothing
_PROCESSORS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": None,
               "min_length": 0, "suppress_tokens": None, "begin_suppress_tokens": None,
               "bad_words_ids": None, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
               "eta_cutoff": 0.0, "encoder_repetition_penalty": 1.0, "forced_bos_token_id": None,
               "forced_eos_token_id": None, "sequence_bias": None, "length_penalty": 1.0,
               "num_beams": 1}


def _unsupported_generation_settings(model: nn.Module) -> dict[str, Any]:
    """The model's generation-config settings that would change ``generate``'s tokens and
    that the fused generate does not implement."""
    gc = getattr(model, "generation_config", None)
    if gc is None:
        return {}
    out = {}
    for name, neutral in _PROCESSORS.items():
        value = getattr(gc, name, neutral)
        if value not in (neutral, None) and not (name == "min_length" and value == 0):
            out[name] = value
    return out


def _cache_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s keys and values ``(B, KV, T, hd)`` from a ``transformers`` cache."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


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

    def __init__(self, model: nn.Module, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.model = model
        self.config = check_model(model)
        window = getattr(self.config, "sliding_window", None)
        #: positions attention may span: the sliding window where the model has one in use
        self.window = (int(window) if window is not None
                       and getattr(self.config, "use_sliding_window", True) else None)
        self._limits = [n for n in (self.window, position_limit(model)) if n is not None]
        unsupported = _unsupported_generation_settings(model)
        if unsupported:
            raise UnsupportedModel(f"the model's generation config sets {unsupported}, which "
                                   "the fused step's generate does not apply")
        self.stack: Any = None
        self._bind(min([capacity, *self._limits]))

    def _state(self) -> list[tuple[object, ...]]:
        """What the bound copies depend on: every parameter and floating buffer by name,
        object, address, dtype, shape and version (a ``.data`` swap, ``load_state_dict(...,
        assign=True)``, ``.to(dtype)`` or an in-place update all change it)."""
        tensors = [*self.model.named_parameters(),
                   *((n, b) for n, b in self.model.named_buffers() if b.is_floating_point())]
        return [(n, id(t), t.data_ptr(), t.dtype, tuple(t.shape), t._version)
                for n, t in tensors]

    def _bind(self, capacity: int) -> None:
        """Builds the step for ``capacity`` positions; on failure the previous step (if
        any) stays as it was."""
        state = self._state()
        old, self.stack = self.stack, None  # the old arena may be freed for the new one
        try:
            arena = WeightArena()
            build_stack(self.model, capacity, arena)  # counting pass: the arena's size
            arena.allocate()
            stack = build_stack(self.model, capacity, arena)
        except BaseException:
            self.stack = old
            raise
        self.stack, self._capacity, self._bound_state = stack, capacity, state
        #: whether the weights' memory was advised for transparent huge pages
        #: (see structlm.ops.weight_arena; the kernel may still back it with small pages)
        self.huge_pages = arena.huge_pages
        self.weight_bytes = arena.nbytes

    def _fresh(self, needed: int) -> None:
        """Rebinds when a parameter changed since binding or the caches are too short."""
        limit = position_limit(self.model)
        if limit is not None and needed > limit:
            raise ValueError(f"{needed} positions exceed the model's {limit} position "
                             "embeddings")
        if self.window is not None and needed > self.window:
            raise UnsupportedModel(f"{needed} positions exceed the sliding-window attention's "
                                   f"window of {self.window}: the fused step attends to every "
                                   "cached position (no window)")
        if needed > self._capacity:
            self._bind(min([1 << (needed - 1).bit_length(), *self._limits]))
        elif self._state() != self._bound_state:
            self._bind(self._capacity)

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
            token = self.stack.step(token, pos + i).float().argmax(dim=-1)
            out.append(token)
        return torch.stack(out, dim=1)

    def _prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Runs the prompt through the model, loads its keys and values; last logits."""
        with torch.no_grad():
            out = self.model(input_ids=input_ids, use_cache=True)
        self.stack.reset(input_ids.shape[0])
        for i in range(len(decoder_layers(self.model))):
            k, v = _cache_kv(output_cache(out), i)
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
            logits = self.stack.step(nxt, T + i).float()  # as generate: float32 logits
        return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1)


def fused_decoder_or_none(model: nn.Module, capacity: int = 1024
                          ) -> tuple[FusedDecoder | None, str]:
    """The model's :class:`FusedDecoder` and ``""``, or ``None`` and why not."""
    try:
        return FusedDecoder(model, capacity), ""
    except (UnsupportedModel, RuntimeError, TypeError, AttributeError, KeyError,
            ValueError) as e:  # a module the step cannot read: the caller falls back
        return None, f"{type(e).__name__}: {e}"


def fused_decoders(models: dict[str, nn.Module]) -> tuple[dict[str, FusedDecoder] | None,
                                                          dict[str, str]]:
    """Every model's :class:`FusedDecoder`, or ``None`` and why not for each model the step
    does not run: the arms of a speed comparison decode on one path, so a ratio never
    credits one arm with the fused step."""
    found = {name: fused_decoder_or_none(m) for name, m in models.items()}
    why = {name: w for name, (d, w) in found.items() if d is None}
    if why:
        return None, why
    return {name: d for name, (d, _) in found.items() if d is not None}, {}
