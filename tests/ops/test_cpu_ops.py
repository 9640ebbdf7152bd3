"""The compiled CPU kernels as ``torch.library`` custom ops: schema and fake
implementations (``opcheck``), ``torch.compile`` tracing them as opaque ops with the
eager result, and eager calls bypassing the op wrapper."""

from __future__ import annotations

import pytest
import torch

from structlm import AlgebraLinear
from structlm.ops import cpu_kernels, cpu_ops
from structlm.ops.cpu_kernels import block_tables, packed_weight, typed_weight

pytestmark = pytest.mark.skipif(not cpu_kernels.fused_rows_available(),
                                reason="no C++ compiler: the fused-rows kernel cannot be built")


def _layer(seed: int = 0) -> AlgebraLinear:
    torch.manual_seed(seed)
    return AlgebraLinear(7 * 4, 5 * 4, "Q2^2", bias=True)


@pytest.mark.parametrize("typed", [True, False])
def test_rows_op_passes_opcheck(typed: bool) -> None:
    layer = _layer()
    x = torch.randn(3, layer.in_features)
    types = torch.tensor([2, 2, 2]) if typed else torch.tensor([0, 3, 1])
    copy = typed_weight(layer.weight.detach(), layer.plan) if typed else packed_weight(
        layer.weight.detach(), layer.plan)
    args = (x, copy, types, *block_tables(layer.plan), layer.plan.q, layer.out_features,
            layer.bias.detach(), typed)
    torch.library.opcheck(cpu_ops.cpu_rows_linear, args)
    with torch.no_grad():
        expected = layer(x, types)
    torch.testing.assert_close(cpu_ops.cpu_rows_linear(*args), expected)


def test_dense_and_swiglu_ops_pass_opcheck() -> None:
    torch.manual_seed(1)
    x, w, b = torch.randn(2, 97), torch.randn(7, 97), torch.randn(7)
    torch.library.opcheck(cpu_ops.cpu_dense_rows, (x, w, b))
    torch.testing.assert_close(cpu_ops.cpu_dense_rows(x, w, b), x @ w.T + b)
    gate, up, down = torch.randn(33, 16), torch.randn(33, 16), torch.randn(16, 33)
    xs = torch.randn(3, 16)
    tables = cpu_kernels.ffn_kernel_args(gate, up, down)[3:]
    args = (xs, gate, up, down, torch.zeros(3, dtype=torch.int64), tables, 1, True)
    torch.library.opcheck(cpu_ops.cpu_swiglu_rows, args)
    # float64 reference; float32 rounding over 33-term sums of magnitudes ~100 bounds the
    # error by the output's scale (an element near cancellation failed atol 1e-5 in CI)
    g, u, d, x64 = gate.double(), up.double(), down.double(), xs.double()
    ref = (torch.nn.functional.silu(x64 @ g.T) * (x64 @ u.T)) @ d.T
    out = cpu_ops.cpu_swiglu_rows(*args)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5,
                               atol=2e-6 * ref.abs().max().item())


def test_compile_traces_the_kernel_as_an_op_with_the_eager_result() -> None:
    """Under ``torch.compile`` the few-row path is the registered op (no gate turns the
    kernel off while compiling), and the compiled layer matches eager."""
    layer = _layer(2)
    x = torch.randn(1, 1, layer.in_features)
    types = torch.tensor([[3]])
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        eager = layer(x, layer.partition(types))
        compiled = torch.compile(lambda v: layer(v, layer.partition(types)), backend=backend)(x)
    torch.testing.assert_close(compiled, eager)
    assert any("structlm.cpu_rows_linear" in s for s in seen), seen


def test_eager_calls_skip_the_op_wrapper(monkeypatch) -> None:
    """The ~28 µs wrapper is not paid in eager decoding: the op is not called."""
    layer = _layer(3)
    calls = {"n": 0}
    real = cpu_ops.cpu_rows_linear

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(cpu_ops, "cpu_rows_linear", counting)
    with torch.no_grad():
        layer(torch.randn(1, layer.in_features), layer.partition(torch.tensor([1])))
    assert calls["n"] == 0
