"""``DecodeLinear`` and the algebra layer's decode fast path against plain references.

Rule: ``err(kernel) <= 2 * err(plain PyTorch in the same dtype)`` against float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from structlm import AlgebraLinear
from structlm.nn import DecodeLinear
from structlm.ops import Backend, cpu_kernels
from structlm.ops.route import DECODE_MAX_ROWS, DENSE_KERNEL_MAX_ROWS, force_layout

pytestmark = pytest.mark.skipif(not cpu_kernels.fused_rows_available(),
                                reason="no C++ compiler: the rows kernel cannot be built")


def _rule(fast: torch.Tensor, plain: torch.Tensor, exact: torch.Tensor, k: int) -> None:
    assert fast.dtype == plain.dtype and fast.shape == exact.shape
    assert torch.isfinite(fast).all()
    err_fast = (fast.double() - exact).abs().max().item()
    err_plain = (plain.double() - exact).abs().max().item()
    floor = 4 * torch.finfo(fast.dtype).eps * k  # rounding of a k-term sum of O(1) terms
    assert err_fast <= 2 * err_plain + floor, (err_fast, err_plain)


@pytest.mark.parametrize("k,n", [(1, 7), (7, 1), (97, 1025), (1025, 97), (768, 2304)])
@pytest.mark.parametrize("rows", [1, 3, DECODE_MAX_ROWS, 5, 17, DENSE_KERNEL_MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decode_linear_matches_f_linear(k: int, n: int, rows: int, bias: bool,
                                        dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(k * 131 + n * 7 + rows)
    layer = DecodeLinear(k, n, bias=bias, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen, dtype=torch.float64))
        if bias:
            layer.bias.copy_(torch.randn(n, generator=gen, dtype=torch.float64))
    x = torch.randn(rows, 1, k, generator=gen, dtype=torch.float64)  # leading dims (rows, 1)
    w64 = layer.weight.detach().double()
    b64 = None if layer.bias is None else layer.bias.detach().double()
    with torch.no_grad():
        fast = layer(x.to(dtype))
        plain = F.linear(x.to(dtype), layer.weight, layer.bias)
    assert fast.shape == (rows, 1, n)
    _rule(fast, plain, F.linear(x, w64, b64), k)


def test_decode_linear_other_calls_are_f_linear() -> None:
    """More rows, bf16, or a graph to record: exactly ``F.linear`` (and gradients flow)."""
    gen = torch.Generator().manual_seed(3)
    layer = DecodeLinear(33, 17, bias=True)
    many = torch.randn(DENSE_KERNEL_MAX_ROWS + 1, 33, generator=gen)
    with torch.no_grad():
        assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))
        half = layer.to(torch.bfloat16)
        xb = many[:1].to(torch.bfloat16)
        assert torch.equal(half(xb), F.linear(xb, half.weight, half.bias))
    layer = DecodeLinear(33, 17, bias=True)
    x = torch.randn(1, 33, generator=gen, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.detach().sum(0, keepdim=True))
    assert layer.weight.grad is not None and layer.bias.grad is not None


def test_decode_linear_is_an_nn_linear() -> None:
    """Same parameters and state dict as ``nn.Linear``: checkpoints load both ways."""
    ref = nn.Linear(12, 5)
    layer = DecodeLinear(12, 5)
    layer.load_state_dict(ref.state_dict())
    assert isinstance(layer, nn.Linear) and list(layer.state_dict()) == ["weight", "bias"]
    x = torch.randn(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), ref(x))
        assert layer(torch.randn(0, 12)).shape == (0, 5)


def test_dense_rows_linear_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="dtype"):
        cpu_kernels.dense_rows_linear(torch.randn(1, 8, dtype=torch.float64), torch.randn(4, 8))
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernels.dense_rows_linear(torch.randn(1, 9), torch.randn(4, 8))


@pytest.mark.parametrize("algebra", ["Q4", "Q2^2", "graph:3:0-1,1-2,2-0", "Q2xQ3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_algebra_decode_fast_path_with_bias(algebra: str, dtype: torch.dtype) -> None:
    """A ``TypePartition`` of a few rows (what the model passes at decode) takes the
    layer's direct kernel call, bias fused; compare with the reference backend."""
    gen = torch.Generator().manual_seed(len(algebra))
    layer = AlgebraLinear(97 * 12, 7 * 12, algebra, bias=True, dtype=dtype)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(layer.out_features, generator=gen))
    exact = AlgebraLinear(layer.in_features, layer.out_features, algebra, bias=True,
                          dtype=torch.float64, backend="reference")
    exact.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    for rows in (1, 2, DECODE_MAX_ROWS):
        x = torch.randn(rows, 1, layer.in_features, generator=gen, dtype=torch.float64)
        types = torch.randint(0, layer.q, (rows, 1), generator=gen)
        part = layer.partition(types)
        with torch.no_grad():
            fast = layer(x.to(dtype), part)
            layer.backend = Backend.REFERENCE
            plain = layer(x.to(dtype), types)
            layer.backend = Backend.AUTO
            want = exact(x, types)
        assert fast.shape == (rows, 1, layer.out_features)
        _rule(fast, plain, want, layer.in_features)


def test_algebra_fast_path_respects_forced_layout_and_backend() -> None:
    """A forced layout other than fused-rows, or the reference backend, is honoured."""
    gen = torch.Generator().manual_seed(11)
    layer = AlgebraLinear(40, 24, "Q2^2", bias=True)
    x = torch.randn(1, 40, generator=gen)
    part = layer.partition(torch.tensor([1]))
    with torch.no_grad():
        fast = layer(x, part)
        with force_layout("output-major"):
            rect = layer(x, part)
        layer.backend = Backend.REFERENCE
        ref = layer(x, part)
    torch.testing.assert_close(fast, rect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)


def test_dense_rows_gate_leaves_a_trained_or_strided_bias_to_f_linear() -> None:
    """A bias being trained keeps its gradient; a non-contiguous bias works as in
    ``F.linear``."""
    from route_helpers import dense_on_kernel
    from structlm.nn import fast_linear

    gen = torch.Generator().manual_seed(9)
    w = torch.randn(6, 5, generator=gen)
    x = torch.randn(2, 5, generator=gen)
    b = torch.randn(6, generator=gen, requires_grad=True)
    assert not dense_on_kernel(x, w, b)
    fast_linear(x, w, b).sum().backward()
    torch.testing.assert_close(b.grad, torch.full((6,), 2.0))
    strided = torch.randn(12, generator=gen)[::2]
    with torch.no_grad():
        assert not dense_on_kernel(x, w, strided)
        torch.testing.assert_close(fast_linear(x, w, strided), F.linear(x, w, strided))
        assert dense_on_kernel(x, w, strided.contiguous())
