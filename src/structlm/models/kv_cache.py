"""A KV cache that appends into spare capacity instead of re-concatenating every step.

``transformers``' ``DynamicLayer`` grows by ``torch.cat`` of the whole cache with the new
token, so a decode step copies every layer's keys and values again (measured on the
``paper-110m`` model at batch 1: ~80-150 us per layer and step, growing with the
context). :class:`GrowingKVLayer` keeps a buffer with room to spare (capacity doubles
when full) and returns views of its filled prefix: one small copy per step. Everything
else (cropping, beam reordering, ``get_seq_length``) is ``DynamicLayer``'s; where another
method replaced the stored tensors, the next update starts a fresh buffer from them.
While autograd records (training with a cache) or under ``torch.compile`` it
concatenates like ``DynamicLayer``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

__all__ = ["GrowingKVCache", "GrowingKVLayer", "use_growing_layers"]

#: Smallest buffer, in positions.
MIN_CAPACITY = 64


def _is_prefix_of(view: torch.Tensor | None, buf: torch.Tensor | None) -> bool:
    """Whether ``view`` is ``buf[..., :n, :]`` for some ``n`` (same storage and strides)."""
    return (view is not None and buf is not None and view.numel() > 0
            and view.data_ptr() == buf.data_ptr() and view.stride() == buf.stride()
            and view.shape[:-2] == buf.shape[:-2] and view.shape[-1] == buf.shape[-1])


class GrowingKVLayer(DynamicLayer):
    """``DynamicLayer`` whose ``update`` writes into a buffer with spare capacity."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if (torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
                key_states.requires_grad or value_states.requires_grad
                or self.keys.requires_grad or self.values.requires_grad))):
            self._buffers_kv = None
            return super().update(key_states, value_states, *args, **kwargs)
        kb, vb, n = self.reserve(key_states, value_states)
        t = key_states.shape[-2]
        kb[..., n:n + t, :].copy_(key_states)
        vb[..., n:n + t, :].copy_(value_states)
        return self.commit(n + t)

    def reserve(self, key_states: torch.Tensor, value_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Buffers with room for ``key_states.shape[-2]`` more positions after the ``n``
        cached ones (grown, or started from the stored tensors, as needed): returns
        ``(key_buffer, value_buffer, n)``, each buffer ``(B, H, capacity, hs)``. Write the
        new positions at ``n`` onwards, then :meth:`commit`. No autograd."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.get_seq_length(), key_states.shape[-2]
        bufs = getattr(self, "_buffers_kv", None)
        committed = getattr(self, "_committed", None)
        if (committed is not None and committed[0] is self.keys and committed[1] is self.values
                and n + t <= committed[2].shape[-2]
                and committed[2].shape[:-2] == key_states.shape[:-2]
                and committed[2].shape[-1] == key_states.shape[-1]
                and committed[3].shape[-1] == value_states.shape[-1]
                and committed[2].dtype == key_states.dtype
                and committed[2].device == key_states.device):
            return committed[2], committed[3], n  # nothing touched the cache since commit
        if bufs is None or not (
                (n == 0 or (_is_prefix_of(self.keys, bufs[0])
                            and _is_prefix_of(self.values, bufs[1])))
                and n + t <= bufs[0].shape[-2]
                and bufs[0].shape[:-2] == key_states.shape[:-2]
                and bufs[0].shape[-1] == key_states.shape[-1]
                and bufs[1].shape[-1] == value_states.shape[-1]
                and bufs[0].dtype == key_states.dtype and bufs[1].dtype == value_states.dtype
                and bufs[0].device == key_states.device):
            cap = max(2 * (n + t), MIN_CAPACITY)
            kb = key_states.new_empty((*key_states.shape[:-2], cap, key_states.shape[-1]))
            vb = value_states.new_empty((*value_states.shape[:-2], cap, value_states.shape[-1]))
            if n:
                kb[..., :n, :].copy_(self.keys)
                vb[..., :n, :].copy_(self.values)
            bufs = self._buffers_kv = (kb, vb)
        return bufs[0], bufs[1], n

    def commit(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """After :meth:`reserve` and writing: the cache holds the buffers' first
        ``length`` positions; returns the keys and values ``(B, H, length, hs)``."""
        kb, vb = self._buffers_kv
        return self.commit_views(kb[..., :length, :], vb[..., :length, :])

    def commit_views(self, keys: torch.Tensor, values: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`commit` given the views already (a kernel's ``narrow`` of the buffers
        :meth:`reserve` returned): the cache holds ``keys`` and ``values``."""
        kb, vb = self._buffers_kv
        self.keys, self.values = keys, values
        self._committed = (keys, values, kb, vb)
        return keys, values


class GrowingKVCache(DynamicCache):
    """``DynamicCache`` made of :class:`GrowingKVLayer` (one per decoder layer, on demand)."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingKVLayer, offloading=False,
                       offload_only_non_sliding=False)


def use_growing_layers(cache: Any) -> Any:
    """Swap a fresh, plain ``DynamicCache``'s empty layers for :class:`GrowingKVLayer`
    (what ``generate`` builds by default); any other cache (a caller's own, an offloading
    one, one already filled) is returned untouched."""
    if (type(cache) is DynamicCache and not getattr(cache, "_is_user_defined", False)
            and not getattr(cache, "offloading", False)  # offloading moves the tensors
            and all(type(layer) is DynamicLayer and not layer.is_initialized
                    for layer in cache.layers)):
        cache.layers = [GrowingKVLayer() for _ in cache.layers]
        if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
            cache.layer_class_to_replicate = GrowingKVLayer
    return cache
