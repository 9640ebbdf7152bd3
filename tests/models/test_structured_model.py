"""The LM with structured attention scores and with a cross-layer type schedule:
cached decoding equals the full forward, padding keeps absolute positions, the option
changes the model, and a bad config is refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lm_checks import assert_left_padding_matches_alone
from structlm.models import StructLMForCausalLM, config_from_preset
from structlm.nn.structured_scores import structured_scores_reference

CASES = [("Q2^2", "block:3", True), ("Q4", "cyclic", True), ("Q2^2", "cross-layer:block:3", True),
         ("Q2^2", "cross-layer:cyclic", False)]


def _model(algebra: str, schedule: str, structured: bool, seed: int = 0) -> StructLMForCausalLM:
    torch.manual_seed(seed)
    cfg = config_from_preset("tiny", algebra, type_schedule=schedule,
                             structured_scores=structured, num_hidden_layers=5,
                             initializer_range=0.2)
    return StructLMForCausalLM(cfg).eval()


@pytest.mark.parametrize(("algebra", "schedule", "structured"), CASES)
def test_chunked_and_cached_decode_equal_the_full_forward(algebra: str, schedule: str,
                                                          structured: bool) -> None:
    model = _model(algebra, schedule, structured)
    ids = torch.randint(0, 512, (3, 29))
    with torch.no_grad():
        full = model(ids).logits
        cache, parts = None, []
        for a, b in ((0, 7), (7, 8), (8, 20), *((p, p + 1) for p in range(20, 29))):
            out = model(ids[:, a:b], cache=cache, use_cache=True)
            cache = out.cache
            parts.append(out.logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("algebra", "schedule", "structured"), CASES[:3])
def test_generate_with_left_padding_keeps_absolute_positions(algebra: str, schedule: str,
                                                             structured: bool) -> None:
    assert_left_padding_matches_alone(_model(algebra, schedule, structured))


def test_structured_scores_change_the_model_and_follow_the_definition() -> None:
    plain, structured = _model("Q2^2", "block:3", False), _model("Q2^2", "block:3", True)
    structured.load_state_dict(plain.state_dict())  # same parameters: only the scores differ
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        assert (plain(ids).logits - structured(ids).logits).abs().max() > 1e-3
    # layer 0's attention against the definition, from the module's own q and k
    block = structured.transformer.h[0]
    captured = {}
    block.attn.register_forward_pre_hook(lambda mod, args: captured.update(x=args[0]))
    with torch.no_grad():
        structured(ids)
        x = captured["x"]
        b, t, d = x.shape
        q, k, v = (z.view(b, t, 4, d // 4).transpose(1, 2)
                   for z in block.attn.qkv(x).split(d, 2))
        types = structured.transformer.schedule(torch.arange(t)).expand(b, t)
        s = structured_scores_reference(q.double(), k.double(), types, types,
                                        structured.transformer.score_groups)
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        y = (s.softmax(-1) @ v.double()).float().transpose(1, 2).reshape(b, t, d)
        torch.testing.assert_close(block.attn(x, torch.ones(t, t, dtype=torch.bool).tril(),
                                              None, (types, types,
                                                     structured.transformer.score_groups)),
                                   block.attn.proj(y), rtol=1e-5, atol=1e-5)


def test_cross_layer_types_shift_with_the_layer() -> None:
    model = _model("Q2^2", "cross-layer:block:3", False)
    pos = torch.arange(24)[None]
    base = model.transformer.schedule(pos)
    for layer in range(5):
        got = model.transformer.schedule.at_layer(layer)(pos)
        assert torch.equal(got, (base + layer) % 4)


def test_training_backward_reaches_every_group() -> None:
    model = _model("Q4", "block:2", True).train()
    ids = torch.randint(0, 512, (2, 16))
    model(ids, labels=ids).loss.backward()
    g = model.transformer.h[1].attn.qkv.weight.grad
    assert g is not None and bool(torch.isfinite(g).all())
    d = model.config.hidden_size
    q_rows = g[:d].view(4, 4, 2, d)  # (head, group, m, D): every group of every head learns
    assert (q_rows.abs().sum((-1, -2)) > 0).all()


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="needs an algebra"):
        config_from_preset("tiny", "dense", structured_scores=True)
    with pytest.raises(ValueError, match=r"head size 6 .* not divisible by 4"):
        config_from_preset("tiny", "Q4", structured_scores=True, hidden_size=24,
                           num_attention_heads=4)
