"""Attention heads in a conversion: head-aligned groups (whole heads per group where
there are enough heads, equal groups elsewhere; saved and restored), and the head
permutation (the dense function unchanged in every family with separate q/k/v/o, the
grouped-query pairing kept, the two-level assignment optimal against brute force, the
distillation teacher given the student's layout)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm import AlgebraConfig, conversion_info, convert_  # noqa: E402
from structlm.algebra import get_algebra  # noqa: E402
from structlm.config import ConfigError  # noqa: E402
from structlm.convert.distill import dense_teacher  # noqa: E402
from structlm.convert.heads import (  # noqa: E402
    _solve_heads,
    apply_head_orders_,
    attention_shape,
    head_widths,
    permute_heads_,
    site_widths,
)
from structlm.hf.adapters import MatrixType  # noqa: E402
from structlm.nn.schedules import get_schedule  # noqa: E402
from tiny_models import tiny_family, tiny_gpt2, tiny_llama  # noqa: E402


def _ids(n: int, t: int, seed: int, vocab: int = 89) -> torch.Tensor:
    return torch.randint(1, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def test_head_widths_hold_whole_heads_and_fall_back_to_equal() -> None:
    assert head_widths(9, 64, 4) == (128, 128, 128, 192)  # SmolLM2's query heads, Q2^2
    assert head_widths(8, 16, 4) == (32, 32, 32, 32)
    assert head_widths(14, 64, 4) == (192, 192, 256, 256)  # Qwen2.5-0.5B
    assert head_widths(3, 64, 4) is None  # fewer heads than groups
    from structlm.convert.heads import AttentionShape

    smol = AttentionShape(9, 3, 64)
    assert site_widths((MatrixType.Q,), 576, 576, smol, 4) == ((144,) * 4, (128, 128, 128, 192))
    assert site_widths((MatrixType.K,), 576, 192, smol, 4) == ((144,) * 4, (48,) * 4)
    assert site_widths((MatrixType.O,), 576, 576, smol, 4) == ((128, 128, 128, 192), (144,) * 4)
    assert site_widths((MatrixType.MLP_IN,), 576, 1536, smol, 4) == ((144,) * 4, (384,) * 4)
    with pytest.raises(ValueError, match="not 9 heads x 64"):
        site_widths((MatrixType.Q,), 576, 512, smol, 4)


def test_head_groups_convert_save_and_restore(tmp_path) -> None:
    model = tiny_llama(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    cfg = AlgebraConfig("Q2^2", "cyclic", "attn", groups="heads")
    convert_(model, cfg)
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.in_widths, attn.q_proj.out_widths) == ((12,) * 4, (8, 8, 16, 16))
    assert attn.k_proj.out_widths == (4,) * 4  # 2 K/V heads < 4 groups: equal
    assert attn.o_proj.in_widths == (8, 8, 16, 16)
    assert conversion_info(model)["groups"] == "heads"
    ids = _ids(2, 12, 0)
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert back.model.layers[0].self_attn.q_proj.out_widths == (8, 8, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, want, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "olmo2", "gemma2", "gemma3_text",
                                    "gemma3", "mistral"])
def test_the_head_permutation_keeps_the_dense_function(family) -> None:
    model = (tiny_llama(num_attention_heads=8, num_key_value_heads=2, hidden_size=32)
             if family == "llama" else tiny_family(family, num_attention_heads=8,
                                                   num_key_value_heads=2, head_dim=8))
    before = copy.deepcopy(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    orders: dict = {}
    summary = permute_heads_(model, get_algebra("Q2^2"), get_schedule("cyclic", 4),
                             _ids(8, 24, 0, vocab), progress=False, orders=orders)
    other = _ids(3, 20, 1, vocab)
    with torch.no_grad():
        torch.testing.assert_close(model(other).logits, before(other).logits,
                                   rtol=1e-5, atol=1e-5)
    assert len(summary) == 3 and all(s["permuted"] <= s["identity"] * (1 + 1e-12)
                                     for s in summary.values())
    assert any(s["permuted"] < s["identity"] for s in summary.values())
    moved = [n for n, p in model.named_parameters()
             if not torch.equal(p, dict(before.named_parameters())[n])]
    assert moved and all("self_attn" in n for n in moved)
    for q_order, kv_order in orders.values():  # each query head keeps its K/V head
        assert sorted(q_order.tolist()) == list(range(8))
        assert [int(h) // 4 for h in q_order] == [int(k) for k in kv_order.repeat_interleave(4)]


def test_a_random_gqa_preserving_order_keeps_the_function_and_a_broken_one_does_not() -> None:
    model = tiny_llama(num_attention_heads=8, num_key_value_heads=2, hidden_size=32)
    ids = _ids(2, 16, 3)
    with torch.no_grad():
        want = model(ids).logits
    good = copy.deepcopy(model)
    q = torch.tensor([6, 4, 7, 5, 1, 3, 0, 2])  # K/V heads swapped, each block shuffled
    apply_head_orders_(good, {i: (q, torch.tensor([1, 0])) for i in range(3)})
    bad = copy.deepcopy(model)  # query heads moved to another K/V head's block
    apply_head_orders_(bad, {i: (torch.tensor([4, 1, 2, 3, 0, 5, 6, 7]), torch.tensor([0, 1]))
                             for i in range(3)})
    with torch.no_grad():
        torch.testing.assert_close(good(ids).logits, want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(bad(ids).logits, want, atol=1e-3)


def test_the_two_level_assignment_is_optimal() -> None:
    """Against brute force over every GQA-preserving order of 6 query / 3 K/V heads."""
    gen = torch.Generator().manual_seed(0)
    q_cost = torch.rand(6, 6, generator=gen, dtype=torch.float64)
    kv_cost = torch.rand(3, 3, generator=gen, dtype=torch.float64)
    q_order, kv_order, identity, best = _solve_heads(q_cost, kv_cost, 2)
    assert identity == pytest.approx(float(q_cost.diagonal().sum() + kv_cost.diagonal().sum()))
    got = float(q_cost[q_order, torch.arange(6)].sum() + kv_cost[kv_order, torch.arange(3)].sum())
    assert got == pytest.approx(best, rel=1e-12)
    brute = []
    for kv in itertools.permutations(range(3)):
        for inner in itertools.product(itertools.permutations(range(2)), repeat=3):
            order = [kv[t] * 2 + inner[t][i] for t in range(3) for i in range(2)]
            brute.append(float(q_cost[torch.tensor(order), torch.arange(6)].sum()
                               + kv_cost[torch.tensor(kv), torch.arange(3)].sum()))
    assert best == pytest.approx(min(brute), rel=1e-12)


def test_convert_permutes_heads_and_the_teacher_takes_the_layout() -> None:
    dense = tiny_llama(num_attention_heads=8, num_key_value_heads=2, hidden_size=32)
    ids = _ids(16, 32, 0)
    student = convert_(copy.deepcopy(dense), AlgebraConfig(
        "Q2^2", "cyclic", "all", permute=True, groups="heads"), calibration=ids,
        progress=False)
    info = conversion_info(student)
    assert any(k.endswith("heads") for k in info["permutation"])
    assert any(not k.endswith("heads") for k in info["permutation"])  # the FFN's too
    teacher = dense_teacher(dense, student)
    for name in ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.o_proj",
                 "model.layers.2.mlp.down_proj"):  # copy init: the student's weights
        assert torch.equal(teacher.get_submodule(name).weight,
                           student.get_submodule(name).weight)
    other = _ids(2, 16, 5)
    with torch.no_grad():
        torch.testing.assert_close(teacher(other).logits, dense(other).logits,
                                   rtol=1e-5, atol=1e-5)
    calibrated = convert_(copy.deepcopy(dense), AlgebraConfig(
        "Q2^2", "cyclic", "attn", init="calibrated", permute=True, groups="heads"),
        calibration=ids, progress=False)
    mods = conversion_info(calibrated)["calibration"]["modules"]
    assert all(m["calibrated"] <= m["copy"] * (1 + 1e-9) for m in mods.values())


def test_head_options_are_refused_where_they_cannot_apply() -> None:
    with pytest.raises(ConfigError, match="groups: 'heads' aligns"):
        AlgebraConfig("Q2^2", "cyclic", "mlp", groups="heads")
    with pytest.raises(ConfigError, match="groups: 'rows' is not valid"):
        AlgebraConfig("Q2^2", "cyclic", "attn", groups="rows")
    with pytest.raises(ValueError, match=r"head-aligned groups .* need separate q/k/v/o"):
        convert_(tiny_gpt2(), AlgebraConfig("Q4", "cyclic", "attn", groups="heads"))
    assert attention_shape(tiny_gpt2()).heads == 4
