"""Explicit invalidation of the decode accelerator's cached plan (no torch-wide hooks):
after every way structlm or a user changes a model's modules or parameters, the next
decode step runs the new model — checked against the modules' uncached forward."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from route_helpers import on_stack
from structlm import AlgebraConfig, convert_, unconvert_
from structlm.hf.adapters import MatrixType, get_adapter
from structlm.models import StructLMConfig, StructLMForCausalLM
from structlm.models.kv_cache import GrowingKVCache
from structlm.nn import AlgebraLinear, invalidate_fast_paths, structure_epoch
from structlm.nn.factorized import LowRankLinear
from structlm.ops import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.fused_rows_available(),
                                reason="no C++ compiler: the CPU kernels cannot be built")

D, F, V = 24, 48, 61


def _model(algebra: str = "Q2^2", seed: int = 0) -> StructLMForCausalLM:
    torch.manual_seed(seed)
    cfg = StructLMConfig(vocab_size=V, n_positions=64, hidden_size=D, num_hidden_layers=2,
                         num_attention_heads=3, intermediate_size=F, algebra=algebra)
    return StructLMForCausalLM(cfg).eval()


def _step_vs_modules(model: StructLMForCausalLM) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """One cached decode step after a 5-token prefill, and the uncached forward's logits
    at that position; whether the step ran on the decode stack."""
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = GrowingKVCache()
        model(ids[:, :5], cache=cache, use_cache=True)
        stacked = on_stack(model.transformer, torch.randn(2, 1, D), None, cache)
        step = model(ids[:, 5:], cache=cache, use_cache=True).logits[:, -1]
        full = model(ids).logits[:, -1]
    return stacked, step, full


def _fresh_weights(module: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


# each change is prepared (new modules built) before the plan is cached, then applied
Change = Callable[[StructLMForCausalLM], Callable[[], None]]


def _manual_setattr(model: StructLMForCausalLM) -> Callable[[], None]:
    old = model.transformer.h[1].mlp.gate
    new = AlgebraLinear(old.in_features, old.out_features, "Q2^2")
    _fresh_weights(new, 2)
    return lambda: setattr(model.transformer.h[1].mlp, "gate", new)


def _new_parameter(model: StructLMForCausalLM) -> Callable[[], None]:
    new = nn.Parameter(torch.randn(D, generator=torch.Generator().manual_seed(3)))
    return lambda: setattr(model.transformer.h[0].ln_2, "weight", new)


def _replace_block(model: StructLMForCausalLM) -> Callable[[], None]:
    block = type(model.transformer.h[0])(model.config, 0)
    _fresh_weights(block, 4)
    return lambda: model.transformer.h.__setitem__(0, block)


def _load_assign(model: StructLMForCausalLM) -> Callable[[], None]:
    state = _model(seed=9).state_dict()
    return lambda: model.load_state_dict(state, assign=True)


def _backend(model: StructLMForCausalLM) -> Callable[[], None]:
    return lambda: setattr(model.transformer.h[0].mlp.down, "backend", "reference")


def _adapter_replace(model: StructLMForCausalLM) -> Callable[[], None]:
    layer = get_adapter(model).layers[1]
    gen = torch.Generator().manual_seed(5)
    low = LowRankLinear(torch.randn(D, 4, generator=gen) * 0.3,
                        torch.randn(4, D, generator=gen) * 0.3, torch.zeros(D))
    return lambda: layer.replace(MatrixType.O, low)


CHANGES: dict[str, tuple[Change, bool, bool]] = {
    # name: (change, the decode stack still applies, the function changes)
    "setattr a projection": (_manual_setattr, True, True),
    "a new norm parameter": (_new_parameter, True, True),
    "replace a block in the ModuleList": (_replace_block, True, True),
    "load_state_dict(assign=True)": (_load_assign, True, True),
    "set a layer's backend": (_backend, False, False),
    "adapter replace": (_adapter_replace, False, True),
}


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_decode_step_follows_every_change(name: str) -> None:
    model = _model()
    prepare, still_stacked, new_function = CHANGES[name]
    apply = prepare(model)
    stacked, step, full = _step_vs_modules(model)  # builds and caches the plan
    assert stacked
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-4)
    before = structure_epoch()
    apply()
    assert structure_epoch() != before
    stacked, step, full_after = _step_vs_modules(model)
    assert stacked == still_stacked
    assert torch.allclose(full_after, full) != new_function
    torch.testing.assert_close(step, full_after, rtol=1e-4, atol=1e-4)


def test_convert_and_unconvert_invalidate() -> None:
    """``convert_`` turns a dense StructLM's FFN into typed algebra layers (the modules'
    path); ``unconvert_`` brings the decode stack back, with the dense function."""
    model = _model("dense")
    stacked, step, dense_logits = _step_vs_modules(model)
    assert stacked
    convert_(model, AlgebraConfig("Q2^2", targets="mlp"))
    stacked, step, full = _step_vs_modules(model)
    assert not stacked
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-4)
    unconvert_(model)
    stacked, step, full = _step_vs_modules(model)
    assert stacked
    torch.testing.assert_close(step, dense_logits, rtol=1e-4, atol=1e-4)


def test_invalidate_fast_paths_is_public() -> None:
    before = structure_epoch()
    invalidate_fast_paths()
    assert structure_epoch() == before + 1
