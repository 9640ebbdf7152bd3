"""Atomic API calls: every refusal of ``convert_`` and ``unconvert_`` — those checked
before the first change and those that arise during it (a position type the
calibration never shows, an interrupt mid-calibration) — leaves every parameter and
buffer (names, values bit for bit), the modules, the hooks and the conversion record
exactly as they were; low-level misuse gets a clear TypeError."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from structlm import AlgebraConfig, conversion_info, convert_, explain_routes  # noqa: E402
from structlm.convert import unconvert_  # noqa: E402
from structlm.convert.algebra_config import CONFIG_KEY  # noqa: E402
from tiny_models import tiny_llama  # noqa: E402

VOCAB, CONTEXT = 89, 64  # tiny_llama's


def _ids(shape: tuple[int, ...] = (8, 32), seed: int = 3) -> torch.Tensor:
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything a failing call must not change."""
    with torch.no_grad():
        logits = model(_ids((2, 16), seed=9)).logits
    return {
        "tensors": [(n, t.detach().clone()) for n, t in
                    [*model.named_parameters(remove_duplicate=False),
                     *model.named_buffers(remove_duplicate=False)]],
        "modules": [(n, type(m).__name__, id(m)) for n, m in model.named_modules()],
        "hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks)
                     for m in model.modules()),
        "info": copy.deepcopy(conversion_info(model)),
        "record": copy.deepcopy(model.config.__dict__.get(CONFIG_KEY)),
        "has_record": CONFIG_KEY in model.config.__dict__,
        "training": model.training,
        "logits": logits,
    }


def _assert_unchanged(before: dict[str, Any], model: nn.Module) -> None:
    after = _snapshot(model)
    assert [n for n, _ in after["tensors"]] == [n for n, _ in before["tensors"]]
    for (name, a), (_, b) in zip(before["tensors"], after["tensors"], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for key in ("modules", "hooks", "info", "record", "has_record", "training"):
        assert after[key] == before[key], key
    assert torch.equal(after["logits"], before["logits"])


def _interrupt_second_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt in the middle of calibration (after one module was refitted)."""
    from structlm.convert import calibrate

    real, calls = calibrate._fit_module, []

    def fit(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(calibrate, "_fit_module", fit)


_CAL = AlgebraConfig("Q2^2", "cyclic", "mlp", init="calibrated")
_LATE = AlgebraConfig("Q2^2", "block:12", "mlp", init="calibrated")  # 16 tokens: types 0, 1

# id, model builder, convert_ kwargs, error, message, setup
CONVERT_REFUSALS: list[tuple[str, Callable[[], nn.Module], dict[str, Any], type, str,
                             Callable[[pytest.MonkeyPatch], None] | None]] = [
    ("float-ids", tiny_llama, {"config": _CAL, "calibration": _ids().float()}, ValueError,
     "expected integer token ids", None),
    ("ids-beyond-vocabulary", tiny_llama, {"config": _CAL, "calibration": _ids() + VOCAB},
     ValueError, r"token ids must lie in \[0, 89\)", None),
    ("negative-ids", tiny_llama, {"config": _CAL, "calibration": _ids() - VOCAB},
     ValueError, r"token ids must lie in \[0, 89\)", None),
    ("ids-beyond-context", tiny_llama, {"config": _CAL, "calibration": _ids((2, CONTEXT + 1))},
     ValueError, "longer than the model's context of 64 positions", None),
    ("ids-3d", tiny_llama, {"config": _CAL, "calibration": _ids((2, 4, 16))}, ValueError,
     r"shape \(batch, seq\)", None),
    ("ids-as-text", tiny_llama, {"config": _CAL, "calibration": "some text"}, ValueError,
     "not text", None),
    ("bool-ids", tiny_llama, {"config": _CAL, "calibration": _ids() > 40}, ValueError,
     "expected integer token ids", None),
    ("calibrated-without-ids", tiny_llama, {"config": _CAL}, ValueError,
     "needs calibration token ids", None),
    ("ids-with-copy", tiny_llama, {"config": AlgebraConfig("Q2^2"), "calibration": _ids()},
     ValueError, "only used with init='calibrated'", None),
    ("indivisible-width", lambda: tiny_llama(intermediate_size=50), {"config": "Q2^2"},
     ValueError, "not divisible by q=4", None),
    ("filter-selects-nothing", tiny_llama,
     {"config": "Q2^2", "filter_fn": lambda _m, _n: False}, ValueError, "no module matches",
     None),
    ("filter-not-callable", tiny_llama, {"config": "Q2^2", "filter_fn": "up_proj"},
     TypeError, "filter_fn must be callable", None),
    ("config-of-wrong-type", tiny_llama, {"config": 4}, TypeError,
     "config must be an AlgebraConfig, an algebra name", None),
    ("unknown-algebra-name", tiny_llama, {"config": "Q5x"}, ValueError, "Q5x", None),
    ("already-converted", lambda: convert_(tiny_llama(), "Q4"), {"config": "Q2^2"},
     ValueError, "already converted", None),
    # raised during the change, after modules were replaced: rolled back
    ("type-never-in-calibration", tiny_llama, {"config": _LATE, "calibration": _ids((2, 16))},
     ValueError, r"position types \[2, 3\] never occur", None),
    ("permuted-then-type-never-in-calibration", tiny_llama,
     {"config": AlgebraConfig("Q2^2", "block:12", "all", init="calibrated", permute=True,
                              groups="heads"), "calibration": _ids((2, 16))},
     ValueError, r"position types \[2, 3\] never occur", None),
    ("interrupt-mid-calibration", tiny_llama,
     {"config": AlgebraConfig("Q2^2", "cyclic", "mlp", init="calibrated", permute=True),
      "calibration": _ids()}, KeyboardInterrupt, None, _interrupt_second_fit),
]


@pytest.mark.parametrize(("builder", "kwargs", "error", "match", "setup"),
                         [c[1:] for c in CONVERT_REFUSALS],
                         ids=[c[0] for c in CONVERT_REFUSALS])
def test_a_refused_convert_changes_nothing(builder, kwargs, error, match, setup,
                                           monkeypatch) -> None:
    model = builder()
    if setup is not None:
        setup(monkeypatch)
    before = _snapshot(model)
    with pytest.raises(error, match=match):
        convert_(model, progress=False, **kwargs)
    _assert_unchanged(before, model)


def test_the_rolled_back_model_converts_as_a_fresh_one() -> None:
    """After a failed calibrated conversion the model is the dense one: converting it
    again gives exactly what a fresh model gives."""
    model = tiny_llama(seed=4)
    fresh = copy.deepcopy(model)
    with pytest.raises(ValueError, match="never occur"):
        convert_(model, _LATE, calibration=_ids((2, 16)), progress=False)
    cfg = AlgebraConfig("Q2^2", "cyclic", "mlp", init="calibrated", ridge=1e-3)
    ids = _ids((8, 64))
    convert_(model, cfg, calibration=ids, progress=False)
    convert_(fresh, cfg, calibration=ids, progress=False)
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert conversion_info(model) == conversion_info(fresh)


def _replaced_after_conversion() -> nn.Module:
    model = convert_(tiny_llama(), "Q2^2")
    model.model.layers[1].mlp.up_proj = nn.Linear(32, 48, bias=False)
    return model


@pytest.mark.parametrize(("builder", "match"), [
    (tiny_llama, "not converted"),
    (_replaced_after_conversion, "model.layers.1.mlp.up_proj is a Linear, not the converted"),
], ids=["not-converted", "module-replaced-by-hand"])
def test_a_refused_unconvert_changes_nothing(builder, match) -> None:
    model = builder()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=match):
        unconvert_(model)
    _assert_unchanged(before, model)


def test_an_algebra_name_is_a_config() -> None:
    """``convert_(model, "Q4")`` is ``convert_(model, AlgebraConfig(algebra="Q4"))``."""
    by_name, by_config = convert_(tiny_llama(seed=2), "Q4"), tiny_llama(seed=2)
    convert_(by_config, AlgebraConfig(algebra="Q4"))
    assert conversion_info(by_name) == conversion_info(by_config)
    assert conversion_info(by_name)["algebra"] == "Q4"
    ids = _ids((2, 16))
    with torch.no_grad():
        assert torch.equal(by_name(ids).logits, by_config(ids).logits)


@pytest.mark.parametrize("bad", ["smollm2", nn.Linear(4, 4), None])
def test_what_is_not_a_causal_lm_is_named(bad) -> None:
    for call, name in ((lambda: convert_(bad, "Q4"), "convert_"),
                       (lambda: unconvert_(bad), "unconvert_"),
                       (lambda: explain_routes(bad), "explain_routes")):
        with pytest.raises(TypeError, match=f"{name} expects a Hugging Face causal LM"):
            call()


def _bad_ffn_order(model: nn.Module) -> None:
    from structlm.convert.permute import apply_ffn_orders_

    good = torch.randperm(48, generator=torch.Generator().manual_seed(1))
    apply_ffn_orders_(model, {0: good, 2: torch.zeros(48, dtype=torch.long)})


def _bad_head_order(model: nn.Module) -> None:
    from structlm.convert.heads import apply_head_orders_

    apply_head_orders_(model, {0: (torch.tensor([1, 0, 3, 2]), torch.tensor([1, 0])),
                               1: (torch.tensor([1, 0, 2]), torch.tensor([0, 1]))})


def _interrupted_calibrate(model: nn.Module) -> None:
    from structlm.convert.calibrate import calibrate_

    calibrate_(model, conversion_info(model)["modules"], _ids(), 1e-3, progress=False)


@pytest.mark.parametrize(("builder", "call", "error", "match", "setup"), [
    (tiny_llama, _bad_ffn_order, ValueError, "layer 2's FFN order: not a permutation", None),
    (tiny_llama, _bad_head_order, ValueError,
     r"layer 1's query head order: expected an integer tensor of shape \(4,\)", None),
    (lambda: convert_(tiny_llama(), "Q2^2"), _interrupted_calibrate, KeyboardInterrupt, None,
     _interrupt_second_fit),
], ids=["ffn-order", "head-order", "calibrate-interrupted"])
def test_other_in_place_functions_change_nothing_when_they_raise(builder, call, error, match,
                                                                 setup, monkeypatch) -> None:
    model = builder()
    if setup is not None:
        setup(monkeypatch)
    before = _snapshot(model)
    with pytest.raises(error, match=match):
        call(model)
    _assert_unchanged(before, model)
