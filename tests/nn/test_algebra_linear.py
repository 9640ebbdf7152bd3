"""AlgebraLinear: conversion, composition, exact MAC counts, inspection, errors."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from route_helpers import layout_of
from structlm import AlgebraError, AlgebraLinear, get_algebra
from structlm.algebra import Algebra, complete_graph_algebra
from structlm.ops import Backend, cpu_kernels

aten = torch.ops.aten


def test_from_linear_keeps_parameters_bit_for_bit() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    layer = AlgebraLinear.from_linear(lin, "Q2^2")
    assert torch.equal(layer.weight, lin.weight) and torch.equal(layer.bias, lin.bias)
    assert layer.state_dict().keys() == lin.state_dict().keys()
    assert all(torch.equal(layer.state_dict()[k], v) for k, v in lin.state_dict().items())
    fresh = torch.nn.Linear(64, 32)
    fresh.load_state_dict(layer.state_dict())  # state dicts line up both ways


@pytest.mark.parametrize("algebra", ["Q2", "Q4", "Q2^2", "Q3", "Q2xQ2"])
def test_composition_property(algebra: str) -> None:
    """Two stacked square layers of one type == one layer with the product weight."""
    torch.manual_seed(0)
    q = get_algebra(algebra).q
    d = 4 * q
    first = AlgebraLinear(d, d, algebra, dtype=torch.float64)
    second = AlgebraLinear(d, d, algebra, dtype=torch.float64)
    both = first.compose(second)
    x = torch.randn(6 * q, d, dtype=torch.float64)
    types = torch.arange(6 * q) % q
    torch.testing.assert_close(second(first(x, types), types), both(x, types))
    for t in range(q):  # and per type as matrices: T(W1) then T(W2)
        torch.testing.assert_close(second.to_dense(t) @ first.to_dense(t), both.to_dense(t))


def test_composition_unequal_widths() -> None:
    torch.manual_seed(1)
    a = AlgebraLinear(9, 7, "Q2", group_sizes=([4, 5], [3, 4]), dtype=torch.float64)
    b = AlgebraLinear(7, 6, "Q2", group_sizes=([3, 4], [1, 5]), dtype=torch.float64)
    x = torch.randn(10, 9, dtype=torch.float64)
    t = torch.randint(0, 2, (10,))
    torch.testing.assert_close(b(a(x, t), t), a.compose(b)(x, t))


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _inplace_formulas() -> dict:
    def addmm_(self_shape, a_shape, b_shape, *args, out_shape=None, **kw):
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    def baddbmm_(self_shape, a_shape, b_shape, *args, out_shape=None, **kw):
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]

    return {aten.addmm_: addmm_, aten.baddbmm_: baddbmm_}


@pytest.mark.parametrize(
    ("algebra", "m", "kind"),
    [("Q4", 64, "cyclic"), ("Q4", 37, "random"), ("Q8", 64, "cyclic"), ("Q8", 4096, "cyclic"),
     ("Q2^2", 50, "block"), ("Q16", 32, "cyclic"), ("graph:3:0-1,1-2", 30, "random"),
     ("Q4", 1, "cyclic")],
)
def test_blocked_flops_match_cost_model(algebra: str, m: int, kind: str) -> None:
    """Count the FLOPs the blocked path performs: rho M K N forward, 3x for training."""
    torch.manual_seed(0)
    q = get_algebra(algebra).q
    k, n = 12 * q, 6 * q
    layer = AlgebraLinear(k, n, algebra, backend="blocked")
    pos = torch.arange(m)
    types = {"cyclic": pos % q, "block": (pos // 4) % q}.get(kind, torch.randint(0, q, (m,)))
    x = torch.randn(m, k, requires_grad=True)
    macs = layer.macs(types)
    counts = torch.bincount(types, minlength=q).tolist()
    assert Fraction(macs, m * k * n) == layer.mac_ratio(types) == layer.support.mac_ratio(
        layer.in_widths, layer.out_widths, counts)
    rec = _OpRecorder()
    with FlopCounterMode(display=False, custom_mapping=_inplace_formulas()) as fwd, rec:
        y = layer(x, types)
    # a weight being trained never takes the compiled kernel (its copy would be rebuilt
    # after every step): training counts as PyTorch GEMMs
    if layout_of(layer.plan, layer.partition(types), x.detach(), layer.weight.detach(),
                     kernel=not layer.weight.requires_grad) == "fused-rows":
        # one compiled call, invisible to the counter: its loop bounds are the segment
        # tables, whose MACs must be the cost model's (and no aten GEMM ran beside it)
        assert fwd.get_total_flops() == 0
        assert cpu_kernels.fused_rows_macs(layer.plan, layer.partition(types)) == macs
    else:
        assert fwd.get_total_flops() == 2 * macs
    with FlopCounterMode(display=False, custom_mapping=_inplace_formulas()) as bwd, rec:
        y.backward(torch.randn_like(y))
    assert bwd.get_total_flops() == 2 * 2 * macs  # dX and dW each repeat the support
    counted = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_"}
    words = ("mm", "matmul", "dot", "mv", "linear")
    arithmetic = {o for o in rec.ops if any(s in o for s in words)}
    assert arithmetic <= counted, arithmetic - counted


@pytest.mark.parametrize("layout", ["diag-first", "block-major"])
def test_every_layout_does_the_cost_model_flops(layout: str) -> None:
    from structlm.ops.route import force_layout

    with force_layout(layout):
        test_blocked_flops_match_cost_model("Q2^2", 61, "random")
        test_blocked_flops_match_cost_model("Q8", 64, "cyclic")


def test_gemm_calls_bounded_for_small_balanced_batches() -> None:
    """M = 32, cyclic: the number of GEMM calls does not grow with q."""
    calls = {}
    for q in (4, 8, 16, 32):
        layer = AlgebraLinear(8 * q, 8 * q, f"Q{q}", backend="blocked")
        x = torch.randn(32, 8 * q, requires_grad=True)
        rec = _CallCounter()
        with rec:
            layer(x, torch.arange(32) % q).sum().backward()
        calls[q] = rec.gemms
    assert len(set(calls.values())) == 1, calls


class _CallCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket.__name__ in {"mm", "addmm", "addmm_", "bmm", "baddbmm",
                                             "baddbmm_"}:
            self.gemms += 1
        return func(*args, **(kwargs or {}))


def test_to_dense_and_repr() -> None:
    layer = AlgebraLinear(8, 4, "Q2")
    w = layer.weight
    t0 = layer.to_dense(0)  # type 0: row 0 of blocks + diagonal
    # blocks (beta, delta) live at weight[out delta, in beta]
    assert torch.equal(t0[:2, :4], w[:2, :4])  # (0,0)
    assert torch.equal(t0[2:, :4], w[2:, :4])  # (0,1): source 0 -> output 1
    assert torch.equal(t0[2:, 4:], w[2:, 4:])  # (1,1)
    assert (t0[:2, 4:] == 0).all()  # (1,0) forbidden for type 0
    text = repr(layer)
    assert "algebra=Q2" in text and "q=2" in text and "mac_ratio=3/4" in text
    assert "widths=4x2->2x2" in text
    with pytest.raises(ValueError, match="type 2 is out of range"):
        layer.to_dense(2)


def test_dead_parameters_of_general_graph() -> None:
    layer = AlgebraLinear(6, 6, "graph:3:0-1")
    # used blocks: diagonal (3) + edge 0->1; dead: 5 off-diagonal blocks of 2x2
    assert layer.dead_parameters == 5 * 4
    assert AlgebraLinear(8, 8, "Q4").dead_parameters == 0


def test_bad_inputs_have_clear_errors() -> None:
    layer = AlgebraLinear(8, 8, "Q4")
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"position type 4 is out of range.*q=4"):
        layer(x, torch.tensor([0, 1, 4]))
    with pytest.raises(ValueError, match=r"position type -1 is out of range"):
        layer(x, torch.tensor([0, -1, 2]))
    with pytest.raises(ValueError, match=r"last dimension 7, expected in_features=8"):
        layer(torch.randn(3, 7), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"types have shape \(2,\)"):
        layer(x, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="integer tensor"):
        layer(x, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(TypeError, match="dtype"):
        layer(x.double(), torch.tensor([0, 1, 2]))
    with pytest.raises(AlgebraError, match=r"in_features=10 is not divisible by q=4"):
        AlgebraLinear(10, 8, "Q4")
    with pytest.raises(AlgebraError, match=r"out_features=6 is not divisible by q=4"):
        AlgebraLinear(8, 6, "Q4")
    with pytest.raises(AlgebraError, match="unknown algebra name 'Q4x'"):
        AlgebraLinear(8, 8, "Q4x")
    with pytest.raises(AlgebraError, match="sum to 9, expected 8"):
        AlgebraLinear(8, 8, "Q2", group_sizes=([4, 5], [4, 4]))
    with pytest.raises(AlgebraError, match="have 3 entries; need q=2"):
        AlgebraLinear(8, 8, "Q2", group_sizes=([2, 3, 3], [4, 4]))
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        AlgebraLinear(8, 8, "Q2", backend="fast")


def test_non_associative_custom_algebra_refused_by_layer() -> None:
    q2 = complete_graph_algebra(2)
    import numpy as np

    bad = Algebra("bad", 4, np.vstack([q2.entries, [[2, 3, 0]]]),
                  np.concatenate([q2.values, [1.0]]), q2.basis_names, q2.cells, 2)
    with pytest.raises(AlgebraError, match="not associative"):
        AlgebraLinear(4, 4, bad)


def test_partition_shared_across_layers_and_views() -> None:
    layer = AlgebraLinear(16, 16, "Q4", backend="blocked")
    part = layer.partition(torch.arange(40) % 4)
    assert all(s.rows is not None for s in part.sets)  # cyclic rows are strided views
    block = layer.partition((torch.arange(40) // 10) % 4)
    assert all(s.rows is not None and s.rows.step == 1 for s in block.sets)
    x = torch.randn(40, 16)
    other = AlgebraLinear(16, 16, "Q4", backend="reference")
    with torch.no_grad():
        other.weight.copy_(layer.weight)
    torch.testing.assert_close(layer(x, part), other(x, torch.arange(40) % 4))
    with pytest.raises(ValueError, match="partition covers 40 rows"):
        layer(torch.randn(8, 16), part)


def test_backend_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from structlm.ops import force_backend, resolve_backend

    dev = torch.device("cpu")
    assert resolve_backend("auto", dev) is Backend.BLOCKED
    with force_backend("reference"):
        assert resolve_backend("auto", dev) is Backend.REFERENCE
    monkeypatch.setenv("STRUCTLM_BACKEND", "reference")
    assert resolve_backend("auto", dev) is Backend.REFERENCE
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU without the interpreter
    with pytest.raises(RuntimeError, match="not available"):
        resolve_backend("triton", dev)


def test_meta_device_infers_shapes_and_checks_types() -> None:
    """On the meta device (no data) the layer gives the output's shape and dtype, and
    still refuses types of the wrong shape or dtype."""
    layer = AlgebraLinear(16, 12, "Q4", device="meta")
    x = torch.empty(2, 7, 16, device="meta")
    y = layer(x, torch.zeros(2, 7, dtype=torch.long, device="meta"))
    assert y.device.type == "meta" and y.shape == (2, 7, 12) and y.dtype == x.dtype
    with pytest.raises(ValueError, match="leading shape"):
        layer(x, torch.zeros(3, dtype=torch.long, device="meta"))
    with pytest.raises(TypeError, match="integer tensor"):
        layer(x, torch.zeros(2, 7, device="meta"))


@pytest.mark.parametrize(("algebra", "m"), [("Q4", 1), ("Q16", 32), ("Q2^2", 7), ("Q2", 16)])
def test_kernel_loop_macs_match_cost_model(algebra: str, m: int) -> None:
    """Inference on the compiled kernel (invisible to FlopCounterMode): its loop bounds
    do exactly the cost model's MACs, and no aten GEMM runs beside it."""
    if not cpu_kernels.fused_rows_available():
        pytest.skip("no C++ compiler: the rows kernel cannot be built")
    q = get_algebra(algebra).q
    layer = AlgebraLinear(12 * q, 6 * q, algebra, backend="blocked").requires_grad_(False)
    types = torch.arange(m) % q
    part = layer.partition(types)
    x = torch.randn(m, 12 * q)
    assert layout_of(layer.plan, part, x, layer.weight) == "fused-rows"
    with FlopCounterMode(display=False) as fwd:
        layer(x, part)
    assert fwd.get_total_flops() == 0
    assert cpu_kernels.fused_rows_macs(layer.plan, part) == layer.macs(types)
