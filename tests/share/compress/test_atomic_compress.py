"""``compress_model`` checks its inputs before the first module is replaced, and an error
part-way (here: the second type's factorisation, or an interrupt) leaves the model exactly
as it was — every parameter and buffer, by name and value, the module tree, the logits."""

from __future__ import annotations

import pytest
import torch

from structlm.hf.adapters import get_adapter
from structlm.hf.calibration import calibrate
from structlm.share.compress import CompressionConfig, compress_model
from tiny_models import tiny_family, tiny_llama

pytest.importorskip("transformers")


def _state(model: torch.nn.Module) -> tuple[list[tuple[str, str]], dict[str, torch.Tensor],
                                            torch.Tensor]:
    tree = [(n, type(m).__name__) for n, m in model.named_modules()]
    tensors = {n: t.detach().clone() for n, t in [*model.named_parameters(),
                                                  *model.named_buffers()]}
    ids = torch.randint(0, 89, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = model(ids).logits
    return tree, tensors, logits


def _same(before, after) -> None:
    assert after[0] == before[0]
    assert after[1].keys() == before[1].keys()
    for name, t in before[1].items():
        assert torch.equal(after[1][name], t), name
    assert torch.equal(after[2], before[2])


@pytest.mark.parametrize("family", ["llama", "phi3"])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_error_part_way_leaves_the_model_as_it_was(family, error, monkeypatch) -> None:
    import structlm.share.compress.apply as apply

    model = tiny_llama() if family == "llama" else tiny_family("phi3", vocab_size=89)
    ad = get_adapter(model)
    ids = torch.randint(0, 89, (4 * 32,), generator=torch.Generator().manual_seed(3))
    cal = calibrate(ad, ids, seq_len=32, batch_size=2, progress=False)
    before = _state(model)
    real, calls = apply.factorize_plan, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise error("factorisation failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(apply, "factorize_plan", failing)
    with pytest.raises(error, match="factorisation failed"):
        compress_model(ad, cal, CompressionConfig(method="svd-llm-w", types="all",
                                                  target_reduction=0.3))
    assert len(calls) == 3  # two types were replaced before the failure
    _same(before, _state(model))


def test_missing_calibration_is_refused_before_any_change() -> None:
    model = tiny_llama()
    ad = get_adapter(model)
    ids = torch.randint(0, 89, (4 * 32,), generator=torch.Generator().manual_seed(3))
    cal = calibrate(ad, ids, seq_len=32, batch_size=2, progress=False, layers=[0, 1])
    before = _state(model)
    with pytest.raises(KeyError, match="no calibration for layer 2"):
        compress_model(ad, cal, CompressionConfig(method="svd-llm-w", types="all",
                                                  target_reduction=0.3))
    _same(before, _state(model))


@pytest.mark.parametrize(("tokens", "match"), [
    (lambda: torch.rand(2, 32), "integer token ids"),
    (lambda: torch.randint(0, 89, (2, 4, 8)), r"windows \(n, seq\) or one stream"),
    (lambda: torch.full((2, 32), 95), r"outside the model's vocabulary \[0, 89\)"),
    (lambda: torch.randint(0, 89, (1, 65)), r"longer than the model's context \(64"),
])
def test_bad_calibration_tokens_are_refused_before_any_change(tokens, match) -> None:
    model = tiny_llama()
    ad = get_adapter(model)
    ids = torch.randint(0, 89, (4 * 32,), generator=torch.Generator().manual_seed(3))
    cal = calibrate(ad, ids, seq_len=32, batch_size=2, progress=False)
    before = _state(model)
    with pytest.raises(ValueError, match=match):
        compress_model(ad, cal, CompressionConfig(method="svd-llm", types="mlp",
                                                  target_reduction=0.3),
                       calib_tokens=tokens())
    _same(before, _state(model))
