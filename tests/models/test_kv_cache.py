"""The in-place KV cache against transformers' concatenating ``DynamicCache``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from structlm.models import StructLMForCausalLM, config_from_preset  # noqa: E402
from structlm.models.kv_cache import (  # noqa: E402
    MIN_CAPACITY,
    GrowingKVCache,
    GrowingKVLayer,
    use_growing_layers,
)


def _kv(gen: torch.Generator, t: int, b: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(b, 3, t, 5, generator=gen), torch.randn(b, 3, t, 5, generator=gen))


def test_growing_cache_equals_dynamic_cache_through_growth_crop_and_reorder() -> None:
    gen = torch.Generator().manual_seed(0)
    ours, ref = GrowingKVCache(), DynamicCache()
    chunks = [7, 1, 1, 97, 1, MIN_CAPACITY, 3] + [1] * 40  # crosses the capacity twice
    with torch.no_grad():
        for step, t in enumerate(chunks):
            k, v = _kv(gen, t)
            for layer in (0, 1):
                got, want = ours.update(k, v, layer), ref.update(k, v, layer)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            if step == 4:
                ours.crop(-5)
                ref.crop(-5)
            if step == 5:
                idx = torch.tensor([1, 0])
                ours.reorder_cache(idx)
                ref.reorder_cache(idx)
        assert ours.get_seq_length() == ref.get_seq_length() == sum(chunks) - 5
    assert all(isinstance(layer, GrowingKVLayer) for layer in ours.layers)
    buf = ours.layers[0]._buffers_kv[0]
    assert buf.shape[-2] >= ours.get_seq_length()  # spare capacity, not one tensor per step


def test_growing_cache_concatenates_while_autograd_records() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = GrowingKVCache()
    k, v = _kv(gen, 4)
    k.requires_grad_(True)
    cache.update(k, v, 0)
    keys2, _ = cache.update(*_kv(gen, 1), 0)
    keys2.sum().backward()
    assert k.grad is not None and torch.equal(k.grad, torch.ones_like(k))


def test_generate_uses_growing_layers_and_a_user_cache_is_kept() -> None:
    torch.manual_seed(0)
    model = StructLMForCausalLM(config_from_preset("tiny", "Q2^2")).eval()
    prompt = torch.randint(0, 512, (1, 5))
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    cache = getattr(out, "past_key_values", None) or out.cache
    assert cache.layers and all(isinstance(layer, GrowingKVLayer) for layer in cache.layers)
    plain = DynamicCache()
    plain._is_user_defined = True
    assert use_growing_layers(plain) is plain and not plain.layers
    fresh = DynamicCache(config=model.config)
    use_growing_layers(fresh)
    assert all(isinstance(layer, GrowingKVLayer) for layer in fresh.layers)


def test_reserve_and_commit_views_keep_the_cache_exact() -> None:
    """The fused decode step's protocol (reserve, write at ``n``, commit the kernel's
    views), mixed with crops and ordinary updates, equals ``DynamicCache``."""
    gen = torch.Generator().manual_seed(2)
    ours, ref = GrowingKVCache(), DynamicCache()
    with torch.no_grad():
        k, v = _kv(gen, 5)
        ours.update(k, v, 0)
        ref.update(k, v, 0)
        layer = ours.layers[0]
        for step in range(90):  # crosses the capacity (64, then 128)
            if step == 30:
                ours.crop(-3)
                ref.crop(-3)
            if step == 40:
                k, v = _kv(gen, 2)
                ours.update(k, v, 0)
                ref.update(k, v, 0)
            k, v = _kv(gen, 1)
            kb, vb, n = layer.reserve(k, v)
            assert n == ref.get_seq_length() and kb.shape[-2] > n
            kb[..., n:n + 1, :] = k
            vb[..., n:n + 1, :] = v
            layer.commit_views(kb.narrow(2, 0, n + 1), vb.narrow(2, 0, n + 1))
            ref.update(k, v, 0)
            assert torch.equal(layer.keys, ref.layers[0].keys)
            assert torch.equal(layer.values, ref.layers[0].values)
