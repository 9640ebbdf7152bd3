"""Adapters on randomly initialised HF models (no download): matrices, sites, replacement."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from structlm.hf.adapters import (
    MATRIX_TYPES,
    GPT2Adapter,
    LlamaAdapter,
    MatrixType,
    Phi3Adapter,
    StructLMAdapter,
    get_adapter,
    linear_from,
    parse_types,
)
from structlm.models import StructLMForCausalLM
from tiny_models import FAMILY_OVERRIDES, tiny_family, tiny_gpt2, tiny_structlm


def _gpt2() -> GPT2LMHeadModel:
    return tiny_gpt2()


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=3, hidden_size=48, num_attention_heads=6,
                      num_key_value_heads=2, intermediate_size=80, vocab_size=97,
                      max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def _structlm(algebra: str = "dense") -> StructLMForCausalLM:
    return tiny_structlm(algebra=algebra)


MODELS = {"gpt2": (_gpt2, GPT2Adapter), "llama": (_llama, LlamaAdapter),
          "structlm": (_structlm, StructLMAdapter),
          **{mt: (lambda mt=mt: tiny_family(mt), Phi3Adapter if mt == "phi3" else LlamaAdapter)
             for mt in FAMILY_OVERRIDES}}
SEPARATE_QKV = {"llama", "gemma2", "gemma3_text", "gemma3", "qwen3", "olmo2", "qwen2", "mistral"}


def _ids() -> torch.Tensor:
    return torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_adapter_matrices_reproduce_the_hf_forward(name: str) -> None:
    """Each block's matrices (in (out, in) layout) applied to the hooked site inputs give
    exactly the outputs of the model's own modules."""
    make, cls = MODELS[name]
    model = make()
    ad = get_adapter(model)
    assert isinstance(ad, cls) and ad.num_layers == 3
    layer = ad.layers[1]
    seen: dict[str, torch.Tensor] = {}
    hooks = [layer.site_module(s).register_forward_pre_hook(
        lambda _m, a, s=s: seen.__setitem__(s, a[0])) for s in
        ("attn_in", "attn_out", "mlp_in", "mlp_out")]
    outs: dict[str, torch.Tensor] = {}
    for s in ("attn_in", "attn_out", "mlp_in", "mlp_out"):
        hooks.append(layer.site_module(s).register_forward_hook(
            lambda _m, _a, o, s=s: outs.__setitem__(s, o)))
    per_type: dict[MatrixType, torch.Tensor] = {}
    if name in SEPARATE_QKV:  # separate q/k/v/o modules: check each against its own output
        for t in (MatrixType.Q, MatrixType.K, MatrixType.V, MatrixType.O):
            hooks.append(layer.module(t).register_forward_hook(
                lambda _m, _a, o, t=t: per_type.__setitem__(t, o)))
    with torch.no_grad():
        model(_ids())
    for h in hooks:
        h.remove()
    for t in MATRIX_TYPES:
        W, b = layer.weight(t), layer.bias(t)
        site = {"q": "attn_in", "k": "attn_in", "v": "attn_in", "o": "attn_out",
                "mlp_in": "mlp_in", "mlp_out": "mlp_out"}[t.value]
        y = seen[site] @ W.T + (0 if b is None else b)
        if t is MatrixType.MLP_IN and outs["mlp_in"].shape[-1] != y.shape[-1]:
            # stacked [gate; up] from two modules: check the gate half
            assert torch.allclose(y[..., : W.shape[0] // 2], outs["mlp_in"], atol=1e-5)
        elif t in (MatrixType.Q, MatrixType.K, MatrixType.V) and name not in SEPARATE_QKV:
            qkv = (MatrixType.Q, MatrixType.K, MatrixType.V)  # fused: rows in that order
            start = sum(layer.weight(u).shape[0] for u in qkv[:qkv.index(t)])
            assert torch.allclose(y, outs["attn_in"][..., start:start + W.shape[0]],
                                  atol=1e-5), t
        elif t in per_type:
            assert torch.allclose(y, per_type[t], atol=1e-5), t
        else:
            assert torch.allclose(y, outs[site], atol=1e-5), t


def test_llama_gqa_shapes() -> None:
    ad = get_adapter(_llama())
    assert ad.layers[0].weight(MatrixType.Q).shape == (48, 48)
    assert ad.layers[0].weight(MatrixType.K).shape == (16, 48)  # 2 KV heads of 8
    assert ad.layers[0].weight(MatrixType.MLP_IN).shape == (160, 48)
    assert ad.layers[0].weight(MatrixType.MLP_OUT).shape == (48, 80)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_replacing_every_matrix_by_an_equal_module_keeps_the_logits(name: str) -> None:
    make, _ = MODELS[name]
    model = make()
    ids = _ids()
    with torch.no_grad():
        before = model(ids).logits
    ad = get_adapter(model)
    for layer in ad.layers:
        for t in MATRIX_TYPES:
            layer.replace(t, linear_from(layer.weight(t), layer.bias(t)))
    for layer in ad.layers:  # all replaced modules are now plain Linear
        for t in MATRIX_TYPES:
            assert isinstance(layer.module(t), torch.nn.Linear)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, atol=2e-5, rtol=1e-5)


def test_replacement_changes_only_its_matrix() -> None:
    model = _gpt2()
    ad = get_adapter(model)
    W = ad.layers[0].weight(MatrixType.K)
    ad.layers[0].replace(MatrixType.K, linear_from(2 * W, ad.layers[0].bias(MatrixType.K)))
    torch.testing.assert_close(ad.layers[0].weight(MatrixType.K), 2 * W)
    assert ad.layers[0].weight(MatrixType.Q).shape == W.shape


def test_algebra_ffn_cannot_be_replaced() -> None:
    ad = get_adapter(_structlm("Q2^2"))
    W = ad.layers[0].weight(MatrixType.MLP_OUT)
    with pytest.raises(ValueError, match="algebra FFN"):
        ad.layers[0].replace(MatrixType.MLP_OUT, linear_from(W, None))


def test_parse_types_and_errors() -> None:
    assert parse_types("attn") == [MatrixType.Q, MatrixType.K, MatrixType.V, MatrixType.O]
    assert parse_types("mlp,q") == [MatrixType.MLP_IN, MatrixType.MLP_OUT, MatrixType.Q]
    with pytest.raises(ValueError, match="unknown matrix type 'x'"):
        parse_types("q,x")
    with pytest.raises(ValueError, match=r"no adapter for model_type 'Linear': supported "
                                         r"model_types are gpt2, llama, .*gemma3.*phi3"):
        get_adapter(torch.nn.Linear(2, 2))
