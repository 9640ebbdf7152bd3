"""Equal-MAC baselines and the MAC / parameter counts of converted, pruned and factorised
models (random small models, real calibration through the share pipeline's hooks)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm import AlgebraConfig, convert_  # noqa: E402
from structlm.convert.baselines import (  # noqa: E402
    ffn_importance,
    projection_macs,
    projection_parameters,
    prune_ffn_width_,
)
from structlm.share.adapters import get_adapter  # noqa: E402
from structlm.share.calibration import calibrate  # noqa: E402
from structlm.share.compress import CompressionConfig, compress_model  # noqa: E402
from tiny_models import tiny_gpt2, tiny_llama  # noqa: E402


def _calibrated(model):
    ids = torch.randint(1, model.config.vocab_size, (256,),
                        generator=torch.Generator().manual_seed(1))
    return calibrate(get_adapter(model), ids, seq_len=32, batch_size=2, progress=False)


def test_macs_of_dense_converted_and_factorised_llama() -> None:
    model = tiny_llama()  # d 32, F 48, 3 layers, K/V 16 wide
    attn = 32 * 32 * 2 + 16 * 32 * 2
    ffn = 3 * 32 * 48
    assert projection_macs(model) == 3 * (attn + ffn)
    assert projection_parameters(model) == 3 * (attn + ffn)
    convert_(model, AlgebraConfig("Q2^2"))
    assert projection_macs(model) == 3 * (attn + Fraction(9, 16) * ffn)
    assert projection_parameters(model) == 3 * (attn + ffn)  # every weight kept
    low = tiny_llama()
    compress_model(get_adapter(low), _calibrated(low),
                   CompressionConfig(method="svd", types="mlp", target_reduction=7 / 16))
    macs = projection_macs(low)
    assert macs == projection_parameters(low)  # low rank: MACs = parameters
    target = 3 * (attn + Fraction(9, 16) * ffn)  # ranks round down: at most one rank step
    rank_step = (2 * 48 + 32) + (32 + 48)  # of the stacked [gate; up] and of down, per layer
    assert target - 3 * rank_step <= macs <= target


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
def test_width_pruning_keeps_the_important_units(make) -> None:
    model = make()
    cal = _calibrated(model)
    ids = torch.randint(1, model.config.vocab_size, (1, 12),
                        generator=torch.Generator().manual_seed(2))
    full = model(ids).logits
    f = ffn_importance(model, cal)[0].numel()
    kept = prune_ffn_width_(model, cal, keep=f)  # keeping every unit changes nothing
    assert kept[0] == list(range(f))
    torch.testing.assert_close(model(ids).logits, full, rtol=1e-5, atol=1e-5)
    model = make()
    adapter = get_adapter(model)
    site = next(s for s in adapter.layers[1].linear_sites() if "mlp_out" in
                [t.value for t in s.types])
    with torch.no_grad():  # unit 5 of layer 1 writes nothing: the least important
        w = site.module.weight
        (w[5] if type(site.module).__name__ == "Conv1D" else w[:, 5]).zero_()
    before = projection_macs(model)
    kept = prune_ffn_width_(model, _calibrated(model), keep=f - 1)
    assert 5 not in kept[1] and len(kept[1]) == f - 1
    d = adapter.hidden_size
    per_unit = (3 if make is tiny_llama else 2) * d
    assert before - projection_macs(model) == per_unit * len(adapter.layers)
    assert torch.isfinite(model(ids).logits).all()
    with pytest.raises(ValueError, match="keep=0"):
        prune_ffn_width_(model, _calibrated(model), keep=0)
