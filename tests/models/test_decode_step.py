"""The one-call CPU decode step (``models.decode_step``) against the modules' forward.

The reference is the same model decoding with a plain ``DynamicCache``, whose layers
are not ``GrowingKVLayer`` so every block runs its PyTorch modules.
Rule: ``err(fused) <= 2 * err(modules in the same dtype) + slack`` against float64.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from route_helpers import on_stack  # noqa: E402
from structlm.models import (  # noqa: E402
    StructLMConfig,
    StructLMForCausalLM,
    decode_step,
)
from structlm.models.kv_cache import GrowingKVCache  # noqa: E402
from structlm.ops import cpu_kernels  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_kernels.fused_rows_available(),
                                reason="no C++ compiler: the CPU kernels cannot be built")


def _model(algebra: str, dtype: torch.dtype = torch.float32, seed: int = 0,
           schedule: str = "cyclic") -> StructLMForCausalLM:
    """Awkward widths: 56 = 7 heads of 8, FFN 104 (13 per group for q = 8), 3 layers."""
    torch.manual_seed(seed)
    cfg = StructLMConfig(vocab_size=97, n_positions=160, hidden_size=56, num_hidden_layers=3,
                         num_attention_heads=7, intermediate_size=104, algebra=algebra,
                         type_schedule=schedule, bos_token_id=0, eos_token_id=0)
    model = StructLMForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # layer norms and biases away from their 1 / 0 initialisation
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("ln_1.weight")
                                                     or name.endswith("ln_2.weight") else 0.0))
    return model


def _decode(model: StructLMForCausalLM, ids: torch.Tensor, prefill: int, cache: object,
            expect_fused: bool) -> tuple[torch.Tensor, object]:
    """Prefill ``ids[:, :prefill]``, then one token at a time; the logits of every step."""
    calls = {"n": 0}
    stack = decode_step.decode_stack

    def counted(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        return stack(*args, **kwargs)

    decode_step.decode_stack = counted
    try:
        with torch.no_grad():
            out = model(ids[:, :prefill], cache=cache, use_cache=True)
            steps = []
            for t in range(prefill, ids.shape[1]):
                out = model(ids[:, t:t + 1], cache=out.cache, use_cache=True)
                steps.append(out.logits[:, -1])
    finally:
        decode_step.decode_stack = stack
    assert calls["n"] == (ids.shape[1] - prefill if expect_fused else 0)
    return torch.stack(steps, 1), out.cache  # (B, steps, V)


@pytest.mark.parametrize("algebra", ["dense", "Q4", "Q2^2", "Q2^3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("copy", cpu_kernels.DECODE_COPIES)
def test_fused_decode_matches_the_modules(algebra: str, dtype: torch.dtype, copy: str) -> None:
    """Batches of 1 and 4 sequences, 60-token prefill, 7 decode steps crossing the
    cache's first growth (64 positions): logits and cache contents agree."""
    exact_model = _model(algebra, torch.float64)
    model = _model(algebra, dtype)
    gen = torch.Generator().manual_seed(len(algebra))
    for batch in (1, 4):
        ids = torch.randint(0, 97, (batch, 67), generator=gen)
        with cpu_kernels.decode_copy(copy):
            fast, fast_cache = _decode(model, ids, 60, GrowingKVCache(), expect_fused=True)
        plain, plain_cache = _decode(model, ids, 60, DynamicCache(), expect_fused=False)
        exact, _ = _decode(exact_model, ids, 60, DynamicCache(), expect_fused=False)
        err_fast = (fast.double() - exact).abs().max().item()
        err_plain = (plain.double() - exact).abs().max().item()
        assert fast.dtype == dtype and torch.isfinite(fast).all()
        assert err_fast <= 2 * err_plain + 64 * torch.finfo(dtype).eps, (err_fast, err_plain)
        for ours, ref in zip(fast_cache.layers, plain_cache.layers, strict=True):
            torch.testing.assert_close(ours.keys, ref.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(ours.values, ref.values, rtol=1e-4, atol=1e-5)


def test_rows_of_different_types_use_the_block_copy() -> None:
    """Sequences at different positions (explicit position_ids, no padding) have different
    types: the step still runs fused, on the block-packed copies, and stays right."""
    model = _model("Q2^2")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (3, 9), generator=gen)
    shift = torch.tensor([[0], [1], [2]])  # each row's positions start elsewhere
    pos = torch.arange(9)[None] + shift
    outs = []
    for cache in (GrowingKVCache(), DynamicCache()):
        with torch.no_grad():
            out = model(ids[:, :8], position_ids=pos[:, :8], cache=cache, use_cache=True)
            types = model.transformer.schedule(pos[:, 8:]).flatten()
            assert len(set(types.tolist())) == 3
            outs.append(model(ids[:, 8:], position_ids=pos[:, 8:], cache=out.cache,
                              use_cache=True).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)


def test_cached_plan_follows_parameter_changes() -> None:
    """In-place updates, a replaced parameter, a replaced module, another backend or
    weight copy: every decode step still equals the modules' forward."""
    model = _model("Q2^2")
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 97, (2, 12), generator=gen)

    def check() -> None:
        fast, _ = _decode(model, ids, 10, GrowingKVCache(), expect_fused=True)
        plain, _ = _decode(model, ids, 10, DynamicCache(), expect_fused=False)
        torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-5)

    check()
    block = model.transformer.h[1]
    with torch.no_grad():
        block.mlp.gate.weight.mul_(-1.5)  # in place (version bump)
        block.attn.qkv.bias.add_(0.3)
    check()
    block.ln_2.weight = torch.nn.Parameter(torch.randn(56, generator=gen))  # replaced
    check()
    block.mlp.up.weight.data = torch.randn(block.mlp.up.weight.shape, generator=gen)  # swapped
    check()
    fresh = _model("Q2^2", seed=9).transformer.h[0].mlp
    model.transformer.h[0].mlp = fresh  # replaced module
    check()
    with cpu_kernels.decode_copy("blocks"):
        check()
    block.mlp.down.backend = "reference"  # not the kernel's backend: modules' path
    _decode(model, ids, 10, GrowingKVCache(), expect_fused=False)


def test_fused_decode_only_where_it_applies() -> None:
    model = _model("Q4")
    x = torch.randn(2, 1, 56)
    cache = GrowingKVCache()
    with torch.no_grad():
        model(torch.randint(0, 97, (2, 5)), cache=cache, use_cache=True)
        assert on_stack(model.transformer, x, None, cache)
        assert not on_stack(model.transformer, x, None, None)
        assert not on_stack(model.transformer, x[:, :0], None, cache)
        assert not on_stack(model.transformer, x, torch.ones(2, 1, 1, 6, dtype=torch.bool), cache)
        assert not on_stack(model.transformer, torch.randn(5, 1, 56), None, cache)  # > 4 sequences
        assert not on_stack(model.transformer, x.to(torch.bfloat16), None, cache)
        assert not on_stack(model.transformer, x, None, DynamicCache())
    # autograd recording: the modules' path (the kernel has no backward)
    assert not on_stack(model.transformer, x, None, cache)


def test_generate_padded_and_unpadded_agree_with_the_modules() -> None:
    """Through ``generate``: a left-padded batch (the mask keeps the modules' path) and an
    unpadded one (fused) give the same tokens as with a plain ``DynamicCache``."""
    model = _model("Q2^2")
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 97, (2, 6), generator=gen)
    mask = torch.ones_like(ids)
    for m in (mask, torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])):
        kw = dict(attention_mask=m, max_new_tokens=8, do_sample=False, pad_token_id=0)
        ours = model.generate(ids, **kw)
        ref = model.generate(ids, cache=DynamicCache(), **kw)
        assert torch.equal(ours, ref)
