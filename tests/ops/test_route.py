"""The one route decision (structlm.ops.route): its thresholds, its answers per call,
its overrides, its trace, and that no other module makes it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from route_helpers import kernel_rows_per_type
from structlm import AlgebraLinear
from structlm.ops import cpu_kernels
from structlm.ops.route import (
    DECODE_MAX_ROWS,
    DENSE_IN_PLACE_MAX_ROWS,
    DENSE_KERNEL_MAX_ROWS,
    THRESHOLDS,
    AlgebraCall,
    Backend,
    Decision,
    DecodeStepCall,
    DenseCall,
    FFNCall,
    Route,
    choose,
    force_backend,
    force_layout,
    trace,
    untraced,
)
from structlm.settings import triton_interpret

SRC = Path(__file__).resolve().parents[2] / "src" / "structlm"
kernel = pytest.mark.skipif(not cpu_kernels.fused_rows_available(),
                            reason="no C++ compiler: the CPU kernels cannot be built")


def test_every_threshold_says_what_set_it() -> None:
    assert set(THRESHOLDS) == {"decode_max_rows", "kernel_max_rows_per_type",
                               "kernel_portable_max_rows_per_type",
                               "gathered_max_rows_per_type", "gathered_min_q",
                               "output_major_max_rows", "dense_in_place_max_rows",
                               "dense_kernel_max_rows", "triton_decode_max_rows",
                               "output_major_min_rows", "output_major_max_in_width"}
    for name, t in THRESHOLDS.items():
        assert isinstance(t.value, int) and t.value >= 1, name
        assert len(t.meaning) > 20 and len(t.measured) > 20, name
    assert DECODE_MAX_ROWS == THRESHOLDS["decode_max_rows"].value
    assert DENSE_KERNEL_MAX_ROWS == THRESHOLDS["dense_kernel_max_rows"].value


def test_no_other_module_decides_a_route() -> None:
    """The thresholds and the gates live in ops/route.py only: no other core module
    defines a row threshold, a ``*_applies`` gate or reads the overrides' state."""
    core = [p for p in SRC.rglob("*.py")
            if p.name != "route.py" and not {"bench", "experiments", "cli"} & set(p.parts)]
    pattern = re.compile(r"^\s*(\w*(MAX_ROWS|MIN_Q)\w*\s*=|def \w*_applies\(|_FORCED_\w+\s*=)",
                         re.MULTILINE)
    hits = [f"{p.relative_to(SRC)}: {m.group(0).strip()}" for p in core
            for m in pattern.finditer(p.read_text())]
    assert hits == []


def _layer(algebra: str = "Q2^2", k: int = 32, n: int = 16) -> AlgebraLinear:
    torch.manual_seed(0)
    return AlgebraLinear(k, n, algebra)


def _algebra_route(layer: AlgebraLinear, m: int, **kw: object) -> Decision:
    x = torch.randn(m, layer.in_features, dtype=layer.weight.dtype)
    part = layer.partition(torch.arange(m) % layer.q)
    return choose(AlgebraCall(x, layer.weight, layer.plan, part, layer.backend, **kw))


@kernel
def test_algebra_kernel_up_to_its_threshold_then_layouts() -> None:
    layer = _layer("Q4")
    limit = kernel_rows_per_type(torch.float32) * layer.q
    with torch.no_grad():
        assert _algebra_route(layer, 1).route is Route.KERNEL
        assert _algebra_route(layer, limit).route is Route.KERNEL
        above = _algebra_route(layer, limit + 1)
        # float64 (and builds without AVX-512): the portable limit
        wide = _layer("Q4").double()
        portable = THRESHOLDS["kernel_portable_max_rows_per_type"].value * layer.q
        assert _algebra_route(wide, portable).route is Route.KERNEL
        assert _algebra_route(wide, portable + 1).route is not Route.KERNEL
    assert above.route is not Route.KERNEL and above.reason
    # a trained weight never takes the kernel; the backward layout excludes it too
    assert _algebra_route(layer, 1).route is not Route.KERNEL  # grad enabled, requires_grad
    with torch.no_grad():
        assert _algebra_route(layer, 1, kernel=False).route is not Route.KERNEL


def test_algebra_overrides() -> None:
    layer = _layer("Q2^2")
    with torch.no_grad():
        with force_backend("reference"):
            assert _algebra_route(layer, 3).route is Route.REFERENCE
        with force_layout("diag-first"):
            assert _algebra_route(layer, 3).route is Route.DIAG_FIRST
        with force_layout("gathered"):  # not a Q_q support: the usual choice
            assert _algebra_route(layer, 40, kernel=False).route is not Route.GATHERED
    with pytest.raises(ValueError, match="unknown layout 'fast'"), force_layout("fast"):
        pass
    with pytest.raises(ValueError, match="unknown backend 'gpu'"), force_backend("gpu"):
        pass


@kernel
@pytest.mark.parametrize(("rows", "route"), [(1, Route.DENSE_KERNEL),
                                             (DENSE_IN_PLACE_MAX_ROWS, Route.DENSE_KERNEL),
                                             (DENSE_IN_PLACE_MAX_ROWS + 1,
                                              Route.DENSE_KERNEL_PACKED),
                                             (DENSE_KERNEL_MAX_ROWS, Route.DENSE_KERNEL_PACKED),
                                             (DENSE_KERNEL_MAX_ROWS + 1, Route.TORCH)])
def test_dense_rows(rows: int, route: Route) -> None:
    w = torch.randn(7, 5)
    assert choose(DenseCall(torch.randn(rows, 5), w)).route is route


def test_dense_refusals_name_a_reason() -> None:
    w = torch.randn(7, 5)
    trained = torch.randn(7, requires_grad=True)
    for call in (DenseCall(torch.randn(1, 5), w, trained),  # autograd records the bias
                 DenseCall(torch.randn(1, 5, dtype=torch.bfloat16), w.bfloat16()),
                 DenseCall(torch.randn(1, 4), w)):  # shape mismatch: F.linear raises
        d = choose(call)
        assert d.route is Route.TORCH and d.reason


@kernel
def test_ffn_and_decode_step() -> None:
    x = torch.randn(1, 1, 8)
    ws = (torch.randn(12, 8), torch.randn(12, 8), torch.randn(8, 12))
    with torch.no_grad():
        assert choose(FFNCall(x, "dense", ws)).route is Route.SWIGLU_KERNEL
        assert choose(FFNCall(torch.randn(1, 5, 8), "dense", ws)).route is Route.MODULES
        assert choose(FFNCall(x, None, ws)).route is Route.MODULES
        ready = dict(padded=False, cache_ready=True, layerwise=False, trained=False,
                     blocks_ready=True)
        assert choose(DecodeStepCall(x, **ready)).route is Route.DECODE_STACK
        for fact, value in (("padded", True), ("cache_ready", False), ("layerwise", True),
                            ("trained", True), ("blocks_ready", False)):
            d = choose(DecodeStepCall(x, **{**ready, fact: value}))
            assert d.route is Route.MODULES and d.reason, fact
        many = torch.randn(DECODE_MAX_ROWS + 1, 1, 8)
        assert choose(DecodeStepCall(many, **ready)).route is Route.MODULES


def test_trace_records_with_context_and_untraced_hides() -> None:
    layer = _layer()
    with torch.no_grad(), trace(lambda: "here") as records:
        layer(torch.randn(2, 32), torch.tensor([0, 1]))
        with untraced():
            layer(torch.randn(2, 32), torch.tensor([0, 1]))
    assert len(records) == 1
    assert type(records[0].call) is AlgebraCall and records[0].context == "here"
    with pytest.raises(TypeError, match="choose\\(\\) takes"):
        choose("not a call")  # type: ignore[arg-type]


@pytest.mark.skipif(triton_interpret(), reason="TRITON_INTERPRET=1: Triton runs on the CPU")
def test_explicit_triton_without_a_device_is_refused() -> None:
    layer = AlgebraLinear(8, 8, "Q2", backend=Backend.TRITON)
    with pytest.raises(RuntimeError, match="backend 'triton' is not available"):
        layer(torch.randn(1, 8), torch.tensor([0]))
