"""The fused decode step (structlm.hf.fused_decode) against the model's own forward and
``generate``: plain, converted and compressed LLaMA-family models, greedy and sampled."""

from __future__ import annotations

import pytest
import torch

from structlm.convert import AlgebraConfig, convert_
from structlm.hf.adapters.modules import ConcatProjection, GatedMLP
from structlm.hf.decode import use_decode_kernels_
from structlm.hf.fused_decode import FusedDecoder, UnsupportedModel, fused_decoder_or_none
from structlm.nn.factorized import (
    LowRankLinear,
    OneSidedLinear,
    SharedBasis,
    SharedBasisLinear,
)
from structlm.ops import cpu_kernels
from tiny_models import tiny_family, tiny_gpt2, tiny_llama

pytestmark = pytest.mark.skipif(not cpu_kernels.fused_rows_available(),
                                reason="the CPU kernels are not built here")


def _spread(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Weights large enough that greedy choices are far from ties (HF's 0.02 init makes
    nearly uniform logits, where a 1e-6 difference could flip an argmax)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
            elif "norm" in name or ".ln_" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _tiny(family: str, **overrides: object) -> torch.nn.Module:
    """A tiny random model of the family (hidden 48, FFN 80, 4 query / 2 KV heads)."""
    if family == "llama":
        return tiny_llama(hidden_size=48, intermediate_size=80, vocab_size=97, **overrides)
    if family == "gpt2":
        return tiny_gpt2(**overrides)
    if family == "gemma3_text":  # its tiny window (8) would end every test early
        overrides = {"sliding_window": 64, **overrides}
    return tiny_family(family, **overrides)


def _prompt(vocab: int, n: int = 7, batch: int = 1, seed: int = 3) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _check_against_forward(model: torch.nn.Module, steps: int = 12, batch: int = 1) -> None:
    """Greedy tokens equal ``model.generate``'s; every step's logits equal the model's
    full forward over the same sequence."""
    vocab = model.config.vocab_size
    ids = _prompt(vocab, batch=batch)
    dec = FusedDecoder(model, capacity=32)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        out = dec.generate(ids, max_new_tokens=steps, eos_token_id=None)
        assert torch.equal(out, ref)
        full = model(out).logits  # (B, T + steps, V)
        dec.generate(ids, max_new_tokens=1, eos_token_id=None)  # prefill again
        T = ids.shape[1]
        for i in range(steps - 1):
            logits = dec.step(out[:, T + i].contiguous(), T + i)
            torch.testing.assert_close(logits, full[:, T + i], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3", "phi3", "olmo2",
                                    "gemma2", "gemma3_text", "gpt2"])
def test_plain_models_match_generate(family: str) -> None:
    model = _spread(_tiny(family))
    if family == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None  # biases exercised
    if family == "qwen3":  # per-head q/k norms
        assert model.model.layers[0].self_attn.q_norm.weight.numel() == 12
    if family == "olmo2":  # full-width q/k norms, norms after attention and MLP
        assert model.model.layers[0].self_attn.q_norm.weight.numel() == 48
    if family == "gemma2":  # soft-capped attention and final logits
        assert model.config.attn_logit_softcapping and model.config.final_logit_softcapping
    _check_against_forward(model)


def test_gemma3_local_and_global_rotary_tables() -> None:
    """Sliding (local base) and full (global base) layers read different rotary tables."""
    model = _spread(_tiny("gemma3_text", layer_types=["sliding_attention", "full_attention",
                                                      "sliding_attention"]))
    assert model.config.rope_parameters["sliding_attention"] != model.config.rope_parameters[
        "full_attention"]
    _check_against_forward(model)


def test_gpt2_variants() -> None:
    """Exact GELU, attention scaled by the inverse layer index, untied head."""
    model = _spread(tiny_gpt2(activation_function="gelu", scale_attn_by_inverse_layer_idx=True,
                              tie_word_embeddings=False))
    _check_against_forward(model)
    with pytest.raises(ValueError, match="position embeddings"):
        FusedDecoder(model).generate(_prompt(97), max_new_tokens=60, eos_token_id=None)


def test_batch_and_decode_kernels() -> None:
    model = _spread(tiny_llama(tie_word_embeddings=False))
    use_decode_kernels_(model)  # DecodeLinear projections are dense rows too
    _check_against_forward(model, batch=3)


def test_float64_model() -> None:
    model = _spread(_tiny("qwen2")).double()
    _check_against_forward(model)
    assert FusedDecoder(model).stack.step(torch.tensor([3]), 0).dtype == torch.float64


def test_rotary_scaling_tables_come_from_the_model() -> None:
    model = _spread(tiny_llama(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    _check_against_forward(model)


def test_partial_rotary_phi3() -> None:
    model = _spread(tiny_family("phi3", partial_rotary_factor=0.5))
    assert model.model.rotary_emb(torch.ones(1), torch.arange(3)[None])[0].shape[-1] == 6
    _check_against_forward(model)


@pytest.mark.parametrize(("family", "targets"), [("llama", "mlp"), ("llama", "all"),
                                                 ("phi3", "all"), ("gpt2", "all"),
                                                 ("olmo2", "all"), ("gemma2", "all")])
def test_converted_model_reads_each_positions_type(family: str, targets: str) -> None:
    model = _spread(_tiny(family))
    convert_(model, AlgebraConfig("Q2^2", "cyclic", targets))
    _check_against_forward(model, steps=13)  # positions 7..19: every type of Q2^2


def test_compressed_layers_stay_factorised() -> None:
    model = _spread(_tiny("llama"))
    gen = torch.Generator().manual_seed(5)
    d, f = 48, 80
    layers = model.model.layers
    basis = SharedBasis(torch.randn(16, d, generator=gen) * 0.2,
                        torch.randn(f, 12, generator=gen) * 0.2)
    for i, block in enumerate(layers):
        block.self_attn.o_proj = LowRankLinear(torch.randn(d, 8, generator=gen) * 0.3,
                                               torch.randn(8, d, generator=gen) * 0.3, None)
        res = ((torch.randn(f, 4, generator=gen) * 0.2, torch.randn(4, d, generator=gen) * 0.2)
               if i == 0 else None)
        block.mlp.up_proj = SharedBasisLinear(basis, torch.randn(12, 16, generator=gen),
                                              None, residual=res)
    # Basis Sharing's layout: a GatedMLP whose MLP-in is [gate, up] as two one-sided layers
    one_sided = SharedBasis(torch.randn(20, d, generator=gen) * 0.2, None)
    mlp = layers[2].mlp
    layers[2].mlp = GatedMLP(ConcatProjection([
        OneSidedLinear(one_sided, torch.randn(f, 20, generator=gen) * 0.3, None),
        OneSidedLinear(one_sided, torch.randn(f, 20, generator=gen) * 0.3, None)]),
        mlp.down_proj, f, mlp.act_fn)
    _check_against_forward(model)


def test_factorised_siblings_run_as_one_stacked_chain() -> None:
    """q, k, v (one-sided over bases two layers share, v low-rank with a bias) and gate,
    up (one-sided over one basis) each run as one stacked chain: the first factors
    stacked, the second block-diagonal. The step still equals the model's forward."""
    from structlm.hf.fused_siblings import Firsts, siblings
    from structlm.ops.weight_arena import WeightArena

    model = _spread(_tiny("llama"))
    gen = torch.Generator().manual_seed(8)
    d, f, kv = 48, 80, 24  # hidden, FFN, 2 KV heads of 12

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.3

    bases = {n: SharedBasis(rand(r, d), None) for n, r in (("q", 11), ("k", 7), ("up", 13))}
    for i, block in enumerate(model.model.layers):
        attn = block.self_attn
        attn.q_proj = OneSidedLinear(bases["q"], rand(d, 11), None)
        attn.k_proj = OneSidedLinear(bases["k"], rand(kv, 7), None)
        attn.v_proj = LowRankLinear(rand(kv, 5), rand(5, d), rand(kv) if i else None)
        mlp = block.mlp
        block.mlp = GatedMLP(ConcatProjection([
            OneSidedLinear(bases["up"], rand(f, 13), None),
            OneSidedLinear(bases["up"], rand(f, 13), None)]), mlp.down_proj, f, mlp.act_fn)
    mod = cpu_kernels.kernel_for(model.lm_head.weight, model.lm_head.weight)
    attn = model.model.layers[0].self_attn
    assert siblings(mod, [attn.q_proj, attn.k_proj, attn.v_proj], None, Firsts(),
                    WeightArena()) is not None
    assert siblings(mod, [attn.q_proj, attn.o_proj], None, Firsts(), WeightArena()) is None
    _check_against_forward(model)


def test_sampling_draws_what_generate_draws() -> None:
    model = _spread(_tiny("llama"))
    ids = _prompt(model.config.vocab_size)
    dec = FusedDecoder(model)
    kw = dict(max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9, top_k=20)
    with torch.no_grad():
        torch.manual_seed(11)
        ref = model.generate(ids, eos_token_id=None, pad_token_id=0, **kw)
        torch.manual_seed(11)
        out = dec.generate(ids, eos_token_id=None, **kw)
    assert torch.equal(out, ref)


def test_eos_stops_like_generate() -> None:
    model = _spread(_tiny("llama"))
    ids = _prompt(model.config.vocab_size)
    dec = FusedDecoder(model)
    free = dec.generate(ids, max_new_tokens=10, eos_token_id=None)
    stop = int(free[0, ids.shape[1] + 3])  # the 4th new token becomes the EOS
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=stop,
                             pad_token_id=0)
    out = dec.generate(ids, max_new_tokens=10, eos_token_id=stop)
    assert torch.equal(out, ref)
    assert int(out[0, -1]) == stop and out.shape[1] <= ids.shape[1] + 4


def test_changed_weights_and_long_runs_rebind() -> None:
    model = _spread(_tiny("llama"))
    convert_(model, AlgebraConfig("Q2^2", "cyclic", "mlp"))
    dec = FusedDecoder(model, capacity=32)
    ids = _prompt(model.config.vocab_size)
    dec.generate(ids, max_new_tokens=4, eos_token_id=None)
    with torch.no_grad():  # an in-place update of an algebra weight: its typed copies are stale
        model.model.layers[1].mlp.down_proj.weight.mul_(1.5)
        ref = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    assert torch.equal(dec.generate(ids, max_new_tokens=20, eos_token_id=None), ref)
    assert dec.stack.capacity == 32
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    assert torch.equal(dec.generate(ids, max_new_tokens=40, eos_token_id=None), ref)
    assert dec.stack.capacity == 64  # 47 positions: the next power of two


def test_unsupported_models_are_refused_with_the_reason() -> None:
    with pytest.raises(UnsupportedModel, match="model type 'gemma3'"):
        FusedDecoder(tiny_family("gemma3"))  # the multimodal model
    short = FusedDecoder(tiny_family("mistral", sliding_window=12))  # binds 12 positions
    with pytest.raises(UnsupportedModel, match="sliding-window"):
        short.generate(_prompt(97), max_new_tokens=6, eos_token_id=None)
    with pytest.raises(UnsupportedModel, match="hidden_act 'gelu'"):
        FusedDecoder(tiny_llama(hidden_act="gelu"))
    with pytest.raises(UnsupportedModel, match="dtype"):
        FusedDecoder(tiny_llama().to(torch.bfloat16))
    model = tiny_llama()
    model.model.layers[0].mlp.down_proj = torch.nn.Identity()
    decoder, why = fused_decoder_or_none(model)
    assert decoder is None and "Identity" in why


def test_bad_generate_arguments_are_refused() -> None:
    dec = FusedDecoder(_spread(tiny_llama()))
    ids = _prompt(89, batch=2)
    with pytest.raises(ValueError, match="eos_token_id=None"):
        dec.generate(ids, max_new_tokens=3, eos_token_id=5)
    with pytest.raises(ValueError, match="unpadded"):
        dec.generate(ids, torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1] * 7]), max_new_tokens=3,
                     eos_token_id=None)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate(ids, max_new_tokens=0, eos_token_id=None)
    with pytest.raises(RuntimeError, match="token id"):
        dec.step(torch.tensor([89, 0]), 7)


def _greedy(model: torch.nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)


def test_replaced_parameters_rebind() -> None:
    """A ``.data`` swap and ``load_state_dict(assign=True)`` leave every version counter
    as it was; the decoder still sees them."""
    model = _spread(_tiny("llama"))
    ids = _prompt(97)
    dec = FusedDecoder(model)
    dec.generate(ids, max_new_tokens=4, eos_token_id=None)
    down = model.model.layers[0].mlp.down_proj
    down.weight.data = down.weight.data * 1.7
    assert torch.equal(dec.generate(ids, max_new_tokens=12, eos_token_id=None),
                       _greedy(model, ids, 12))
    state = {k: v * 0.9 if v.dim() == 2 else v for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    assert torch.equal(dec.generate(ids, max_new_tokens=12, eos_token_id=None),
                       _greedy(model, ids, 12))


def test_a_failed_rebind_keeps_the_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    import structlm.hf.fused_decode as fd

    model = _spread(_tiny("llama"))
    ids = _prompt(97)
    dec = FusedDecoder(model, capacity=16)

    def fail(*args: object) -> None:
        raise MemoryError("no room for the arena")

    monkeypatch.setattr(fd, "build_stack", fail)
    with pytest.raises(MemoryError):
        dec.generate(ids, max_new_tokens=30, eos_token_id=None)  # needs a larger capacity
    monkeypatch.undo()
    assert dec.stack is not None and dec.stack.capacity == 16
    assert torch.equal(dec.generate(ids, max_new_tokens=5, eos_token_id=None),
                       _greedy(model, ids, 5))


def test_capacity_growth_stays_within_the_position_table() -> None:
    model = _spread(tiny_gpt2(n_positions=48))
    dec = FusedDecoder(model, capacity=32)
    ids = _prompt(97)
    out = dec.generate(ids, max_new_tokens=33, eos_token_id=None)  # 40 of 48 positions
    assert torch.equal(out, _greedy(model, ids, 33)) and dec.stack.capacity == 48


def test_length_dependent_rotary_matches_decode_beyond_the_original_context() -> None:
    """Dynamic NTK scaling: a decode step's frequencies depend on its own position."""
    model = _spread(tiny_llama(rope_scaling={"rope_type": "dynamic", "factor": 4.0},
                               max_position_embeddings=64))
    rotary = model.model.rotary_emb
    before = rotary.inv_freq.clone()
    ids = _prompt(89)
    out = FusedDecoder(model).generate(ids, max_new_tokens=70, eos_token_id=None)
    assert torch.equal(rotary.inv_freq, before)  # the tables came from a copy
    assert torch.equal(out, _greedy(model, ids, 70))


def test_generation_settings_the_step_does_not_apply_are_refused() -> None:
    model = _spread(_tiny("llama"))
    model.generation_config.repetition_penalty = 1.3
    with pytest.raises(UnsupportedModel, match="repetition_penalty"):
        FusedDecoder(model)
    decoder, why = fused_decoder_or_none(model)
    assert decoder is None and "repetition_penalty" in why
