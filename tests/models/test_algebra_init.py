"""``algebra_init="variance-matched"``: an algebra projection's outputs start with a dense
layer's variance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from structlm.algebra import get_algebra, support_of
from structlm.models import StructLMForCausalLM, config_from_preset
from structlm.nn.algebra_linear import AlgebraLinear


@pytest.mark.parametrize("algebra", ["Q2^2", "Q4", "Q8"])
def test_input_fraction_known_answer(algebra) -> None:
    layer = AlgebraLinear(64, 96, algebra)
    mask = support_of(get_algebra(algebra)).mask  # (type, in group, out group)
    q = mask.shape[0]
    want = mask.sum(axis=1).mean(axis=0) / q  # equal widths: blocks used / q, type-averaged
    got = layer.input_fraction().numpy()
    assert got.shape == (96,)
    np.testing.assert_allclose(got.reshape(q, -1), np.repeat(want[:, None], 96 // q, 1))
    assert float(layer.input_fraction().mean()) == pytest.approx(
        float(layer.mac_ratio()), rel=1e-12)  # the MAC ratio is the same average


def _outputs(init: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit-variance inputs through every FFN projection of a fresh model, each token with
    its schedule's type: (algebra outputs, dense-layer outputs of the same init std)."""
    torch.manual_seed(seed)
    model = StructLMForCausalLM(config_from_preset("study-cpu", "Q2^2", algebra_init=init))
    layers = [m for m in model.modules() if isinstance(m, AlgebraLinear)]
    types = torch.arange(4).repeat_interleave(64)  # (256,) every type equally often
    outs, dense = [], []
    with torch.no_grad():
        for layer in layers:
            x = torch.randn(256, layer.in_features)
            outs.append(layer(x, types).flatten())
            w = torch.randn_like(layer.weight) * model.config.initializer_range
            dense.append((x @ w.T).flatten())
    return torch.cat(outs), torch.cat(dense)


def test_variance_matched_outputs_have_the_dense_variance() -> None:
    plain, dense = _outputs("dense", 0)
    matched, _ = _outputs("variance-matched", 0)
    ratio_plain = float(plain.var() / dense.var())
    ratio_matched = float(matched.var() / dense.var())
    assert ratio_plain == pytest.approx(9 / 16, rel=0.05)  # Q2^2 rows see 9/16 of the input
    assert ratio_matched == pytest.approx(1.0, rel=0.05)


def test_dense_layers_and_the_default_are_unchanged() -> None:
    torch.manual_seed(3)
    a = StructLMForCausalLM(config_from_preset("study-tiny", "dense", algebra_init="dense"))
    torch.manual_seed(3)
    b = StructLMForCausalLM(config_from_preset("study-tiny", "dense",
                                               algebra_init="variance-matched"))
    for (n, p), (_, r) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, r), n
    with pytest.raises(ValueError, match=r"algebra_init.*'variance'.*one of 'dense', "
                                         r"'variance-matched'"):
        config_from_preset("study-tiny", "Q4", algebra_init="variance")
