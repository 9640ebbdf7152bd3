"""Equal-MAC baselines and the MAC / parameter counts of converted, pruned and factorised
models (random small models, real calibration through the share pipeline's hooks)."""

from __future__ import annotations

import functools
from fractions import Fraction

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm import AlgebraConfig, convert_  # noqa: E402
from structlm.experiments.convert.baselines import ffn_importance, prune_ffn_width_  # noqa: E402
from structlm.hf.adapters import get_adapter  # noqa: E402
from structlm.hf.calibration import calibrate  # noqa: E402
from structlm.hf.macs import projection_macs, projection_parameters  # noqa: E402
from structlm.share.compress import CompressionConfig, compress_model  # noqa: E402
from tiny_models import tiny_family, tiny_gpt2, tiny_llama  # noqa: E402


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
                   CompressionConfig(method="svd-llm-w", types="mlp", target_reduction=7 / 16))
    macs = projection_macs(low)
    assert macs == projection_parameters(low)  # low rank: MACs = parameters
    target = 3 * (attn + Fraction(9, 16) * ffn)  # ranks round down: at most one rank step
    rank_step = (2 * 48 + 32) + (32 + 48)  # of the stacked [gate; up] and of down, per layer
    assert target - 3 * rank_step <= macs <= target


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2, functools.partial(tiny_family, "phi3")])
def test_width_pruning_drops_the_dead_units_and_keeps_the_function(make) -> None:
    """Unit 5 of every layer writes nothing: it scores 0, pruning one unit per layer
    removes exactly it (gate and up rows alike, Phi-3's fused [gate; up] and GPT-2's
    Conv1D included) and leaves the logits unchanged."""
    model = make()
    cal = _calibrated(model)
    vocab = (getattr(model.config, "text_config", None) or model.config).vocab_size
    ids = torch.randint(1, vocab, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
    f = ffn_importance(model, cal)[0].numel()
    kept = prune_ffn_width_(model, cal, keep=f)  # keeping every unit changes nothing
    assert kept[0] == list(range(f))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, full, rtol=1e-5, atol=1e-5)
    model = make()
    adapter = get_adapter(model)
    with torch.no_grad():
        for layer in adapter.layers:
            site = next(s for s in layer.linear_sites() if "mlp_out" in
                        [t.value for t in s.types])
            w = site.module.weight
            (w[5] if type(site.module).__name__ == "Conv1D" else w[:, 5]).zero_()
        dead = model(ids).logits
    cal = _calibrated(model)
    assert all(float(s[5]) == 0.0 and int(s.argmin()) == 5 for s in ffn_importance(model, cal))
    before = projection_macs(model)
    kept = prune_ffn_width_(model, cal, keep=f - 1)
    assert all(5 not in k and len(k) == f - 1 for k in kept)
    per_unit = (2 if make is tiny_gpt2 else 3) * adapter.hidden_size  # gated: gate+up+down
    assert before - projection_macs(model) == per_unit * len(adapter.layers)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dead, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="keep=0"):
        prune_ffn_width_(model, _calibrated(model), keep=0)


def test_pruning_refuses_modules_that_are_not_plain_projections() -> None:
    model = convert_(tiny_llama(), AlgebraConfig("Q4"))
    with pytest.raises(ValueError, match=r"plain nn\.Linear / Conv1D projections, got a "
                                         r"TypedAlgebraLinear"):
        prune_ffn_width_(model, _calibrated(tiny_llama()), keep=10)
