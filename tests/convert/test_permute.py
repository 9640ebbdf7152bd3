"""The FFN permutation before a conversion: the dense function is unchanged (logits equal
on any input), the chosen order never costs more than the identity (an exact assignment),
the cost is the error the conversion then makes on each hidden unit, and fused gate/up
projections are refused."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm import AlgebraConfig, conversion_info, convert_  # noqa: E402
from structlm.algebra import get_algebra  # noqa: E402
from structlm.convert.permute import _solve, permute_ffn_  # noqa: E402
from structlm.nn.schedules import get_schedule  # noqa: E402
from tiny_models import tiny_family, tiny_gpt2, tiny_llama  # noqa: E402


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("algebra", ["Q2^2", "Q4"])
def test_the_permutation_keeps_the_dense_function_and_never_costs_more(make, algebra) -> None:
    model = make()
    before = copy.deepcopy(model)
    ids = torch.randint(1, 89, (8, 32), generator=torch.Generator().manual_seed(0))
    other = torch.randint(1, 89, (3, 20), generator=torch.Generator().manual_seed(1))
    summary = permute_ffn_(model, get_algebra(algebra), get_schedule("cyclic", 4), ids,
                           progress=False)
    with torch.no_grad():
        torch.testing.assert_close(model(other).logits, before(other).logits,
                                   rtol=1e-5, atol=1e-5)
    assert len(summary) == 3
    for layer, s in summary.items():
        assert s["permuted"] <= s["identity"] * (1 + 1e-12), layer
    assert any(s["permuted"] < s["identity"] for s in summary.values())
    changed = [n for n, p in model.named_parameters()
               if not torch.equal(p, dict(before.named_parameters())[n])]
    assert changed and all("mlp" in n for n in changed)  # only the FFNs were reordered


def test_the_assignment_is_optimal_with_equal_group_sizes() -> None:
    """Against brute force over every assignment of 6 units to 3 groups of 2."""
    import itertools

    cost = torch.rand(6, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    order = _solve(cost, [2, 2, 2])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    got = float(cost[order, groups].sum())
    best = min(float(cost[torch.tensor(p), groups].sum())
               for p in itertools.permutations(range(6)))
    assert got == pytest.approx(best, rel=1e-12)
    assert sorted(order.tolist()) == list(range(6))


def test_convert_with_permute_records_it_and_the_fit_starts_closer() -> None:
    dense = tiny_llama(vocab_size=97, max_position_embeddings=64)
    ids = torch.randint(1, 97, (32, 32), generator=torch.Generator().manual_seed(0))
    plain = convert_(copy.deepcopy(dense), AlgebraConfig("Q2^2", "cyclic", "mlp",
                                                          init="calibrated"),
                     calibration=ids, progress=False)
    permuted = convert_(copy.deepcopy(dense), AlgebraConfig("Q2^2", "cyclic", "mlp",
                                                             init="calibrated", permute=True),
                        calibration=ids, progress=False)
    info = conversion_info(permuted)
    assert info["permute"] is True and len(info["permutation"]) == 3
    copy_err = [sum(m["copy"] for m in conversion_info(x)["calibration"]["modules"].values())
                for x in (plain, permuted)]
    assert copy_err[1] < copy_err[0]  # the permuted copy already drops less
    # permute with init="copy" reorders and keeps every weight (no refit, no summary)
    kept = convert_(copy.deepcopy(dense), AlgebraConfig("Q2^2", "cyclic", "mlp", permute=True),
                    calibration=ids, progress=False)
    assert "calibration" not in conversion_info(kept)
    order = kept._structlm_conversion.unit_orders[1]
    torch.testing.assert_close(kept.model.layers[1].mlp.down_proj.weight,
                               dense.model.layers[1].mlp.down_proj.weight[:, order],
                               rtol=0, atol=0)


def test_permute_refuses_fused_gate_up_and_non_ffn_targets() -> None:
    from structlm.config import ConfigError

    ids = torch.randint(1, 89, (4, 16))
    with pytest.raises(ValueError, match="fused"):
        convert_(tiny_family("phi3"), AlgebraConfig("Q2^2", "cyclic", "mlp", permute=True),
                 calibration=ids, progress=False)
    with pytest.raises(ConfigError, match="permute: reorders FFN hidden units or attention "
                                          "heads, so targets must hold"):
        AlgebraConfig("Q2^2", "cyclic", "q,k,mlp_in", permute=True)
    with pytest.raises(ConfigError, match="set groups='heads'"):
        AlgebraConfig("Q2^2", "cyclic", "attn", permute=True)
    with pytest.raises(ValueError, match="needs calibration token ids"):
        convert_(tiny_llama(), AlgebraConfig("Q2^2", "cyclic", "mlp", permute=True))
