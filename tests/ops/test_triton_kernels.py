"""Triton kernels (forward fused / two-stage / decode, dX, dW) against the reference.

On a machine without a GPU they run under ``TRITON_INTERPRET=1`` (see conftest.py),
on small awkward shapes. Rule: ``err(triton) <= 2 × err(plain PyTorch in the same
dtype)`` against a float64 reference.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from structlm import AlgebraLinear, get_algebra, support_of  # noqa: E402
from structlm.ops import Backend  # noqa: E402
from structlm.ops.reference import reference_linear  # noqa: E402
from structlm.ops.triton import build_tables  # noqa: E402
from structlm.ops.triton.launch import launch_dw, launch_dx, launch_forward  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _layer(algebra: str, unequal: bool) -> AlgebraLinear:
    q = support_of(get_algebra(algebra)).q
    if unequal:
        in_w = [3 + (5 * i) % 7 for i in range(q)]
        out_w = [2 + (3 * i) % 5 for i in range(q)]
    else:
        in_w, out_w = [40 // q + 1] * q, [24 // q + 1] * q
    return AlgebraLinear(sum(in_w), sum(out_w), algebra, group_sizes=(in_w, out_w), device=DEV)


def _reference(layer: AlgebraLinear, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor,
               g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = reference_linear(x, w, t, layer.support.mask, list(layer.in_widths),
                         list(layer.out_widths))
    dx, dw = torch.autograd.grad(y, [x, w], g)
    return y.detach(), dx, dw


def _assert_rule(name: str, fast: torch.Tensor, plain: torch.Tensor, exact: torch.Tensor,
                 dtype: torch.dtype) -> None:
    err_fast = (fast.double() - exact).abs().max().item()
    err_plain = (plain.double() - exact).abs().max().item()
    floor = 8 * torch.finfo(dtype).eps * (exact.abs().max().item() + 1e-30)
    assert err_fast <= 2 * err_plain + floor, (name, err_fast, err_plain)


CASES = [
    ("Q2", False), ("Q4", False), ("Q4", True), ("Q2^2", False), ("Q2^2", True),
    ("graph:3:0-1,1-2,2-0", True), ("Q2xQ3", False), ("Q8", False), ("Q1", True),
]


def _fp32_cases() -> list:
    """Every case at 1 and 7 rows; 37 rows (several row blocks) on the unequal-width cases,
    and on every case where a GPU runs them: under the CPU interpreter the equal-width
    37-row cases cost ~45 s and are marked slow (`make test-all` runs them)."""
    params = []
    for algebra, unequal in CASES:
        for m in (1, 7, 37):
            slow = m == 37 and not unequal and DEV.type == "cpu"
            params.append(pytest.param(algebra, unequal, m,
                                       marks=[pytest.mark.slow] if slow else []))
    return params


@pytest.mark.parametrize(("algebra", "unequal", "m"), _fp32_cases())
def test_kernels_fp32(algebra: str, unequal: bool, m: int) -> None:
    torch.manual_seed(m)
    layer = _layer(algebra, unequal)
    q = layer.q
    tables = build_tables(layer.plan, layer.support.mask, DEV)
    x = torch.randn(m, layer.in_features, device=DEV)
    w = layer.weight.detach()
    t = (torch.arange(m, device=DEV) * 5 + 3) % q if m > 1 else torch.tensor([q - 1], device=DEV)
    g = torch.randn(m, layer.out_features, device=DEV)
    plain = _reference(layer, x, w, t, g)
    exact = _reference(layer, x.double(), w.double(), t, g.double())
    for mode in ("fused", "two-stage", "decode"):
        _assert_rule(f"y/{mode}", launch_forward(x, w, t, tables, mode), plain[0], exact[0],
                     torch.float32)
    _assert_rule("dx", launch_dx(g, w, t, tables), plain[1], exact[1], torch.float32)
    _assert_rule("dw", launch_dw(g, x, t, tables, tuple(w.shape)), plain[2], exact[2],
                 torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("algebra", ["Q4", "Q2^2"])
def test_kernels_low_precision(dtype: torch.dtype, algebra: str) -> None:
    torch.manual_seed(0)
    layer = _layer(algebra, unequal=True)
    tables = build_tables(layer.plan, layer.support.mask, DEV)
    m = 29
    x = torch.randn(m, layer.in_features, device=DEV).to(dtype)
    w = layer.weight.detach().to(dtype)
    t = torch.randint(0, layer.q, (m,), device=DEV)
    g = torch.randn(m, layer.out_features, device=DEV).to(dtype)
    plain = _reference(layer, x, w, t, g)
    exact = _reference(layer, x.double(), w.double(), t, g.double())
    for mode in ("fused", "two-stage", "decode"):
        y = launch_forward(x, w, t, tables, mode)
        assert y.dtype == dtype
        _assert_rule(f"y/{mode}", y, plain[0], exact[0], dtype)
    _assert_rule("dx", launch_dx(g, w, t, tables), plain[1], exact[1], dtype)
    _assert_rule("dw", launch_dw(g, x, t, tables, tuple(w.shape)), plain[2], exact[2], dtype)


@pytest.mark.parametrize("schedule", ["cyclic", "block"])
def test_layer_backend_autograd_and_batch_dims(schedule: str) -> None:
    torch.manual_seed(1)
    fast = AlgebraLinear(24, 16, "Q4", bias=True, backend="triton", device=DEV)
    ref = AlgebraLinear(24, 16, "Q4", bias=True, backend="reference", device=DEV)
    ref.load_state_dict(fast.state_dict())
    pos = torch.arange(9, device=DEV)
    types = pos % 4 if schedule == "cyclic" else (pos // 3) % 4
    x = torch.randn(2, 9, 24, device=DEV)
    outs = []
    for layer in (fast, ref):
        xi = x.clone().requires_grad_(True)
        y = layer(xi, types)
        y.backward(torch.ones_like(y))
        outs.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compile_fullgraph_and_opcheck() -> None:
    torch.manual_seed(2)
    layer = AlgebraLinear(16, 8, "Q2^2", backend="triton", device=DEV)
    x = torch.randn(6, 16, device=DEV)
    types = torch.arange(6, device=DEV) % 4
    eager = layer(x, types)
    compiled = torch.compile(lambda a, t: layer(a, t), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, types), eager)
    key = layer.__dict__["_triton_tables"][str(x.device)]
    torch.library.opcheck(torch.ops.structlm.algebra_linear,
                          (x, layer.weight.detach(), types, key, "fused"))


def test_triton_errors() -> None:
    layer = AlgebraLinear(8, 8, "Q2", backend="triton", device=DEV, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        layer(torch.randn(3, 8, device=DEV, dtype=torch.float64), torch.tensor([0, 1, 0]))
    layer32 = AlgebraLinear(8, 8, "Q2", backend="triton", device=DEV)
    if DEV.type == "cpu":
        with pytest.raises(ValueError, match="position type 2 is out of range"):
            layer32(torch.randn(3, 8), torch.tensor([0, 1, 2]))


def test_auto_prefers_blocked_on_cpu() -> None:
    from structlm.ops import resolve_backend

    assert resolve_backend("auto", torch.device("cpu")) is Backend.BLOCKED


def test_dispatch_table_loading(tmp_path) -> None:
    import json

    from structlm.ops.route import DISPATCH, load_dispatch
    from structlm.ops.route import triton_route as forward_mode

    path = tmp_path / "dispatch.json"
    path.write_text(json.dumps({"8,4096,4096,2048": "two-stage"}))
    try:
        assert load_dispatch(str(path)) == 1
        assert forward_mode(2048, 8, 4096, 4096) == "triton-two-stage"
        assert forward_mode(1500, 8, 4096, 4096) == "triton-two-stage"  # same M bucket
        assert forward_mode(512, 8, 4096, 4096) == "triton-fused"
        assert forward_mode(2, 8, 4096, 4096) == "triton-decode"
    finally:
        DISPATCH.clear()
    path.write_text(json.dumps({"8,1,1,1": "magic"}))
    with pytest.raises(ValueError, match="'magic'"):
        load_dispatch(str(path))


def test_table_registry_grows_with_distinct_tables_only() -> None:
    """Layers with the same support, widths and device share one registered entry (the
    registry once grew by one entry per layer built)."""
    from structlm.ops.triton.op import _TABLES, register_tables

    layer = _layer("Q2^2", unequal=True)
    key = register_tables(build_tables(layer.plan, layer.support.mask, DEV))
    size = len(_TABLES)
    for _ in range(3):
        twin = _layer("Q2^2", unequal=True)
        assert register_tables(build_tables(twin.plan, twin.support.mask, DEV)) == key
    assert len(_TABLES) == size
    other = _layer("Q4", unequal=False)
    assert register_tables(build_tables(other.plan, other.support.mask, DEV)) != key
