"""The factorised modules' forward (``F.linear`` chains, the two-sided module's choice of
association order) against the dense matrix they stand for, on random inputs and awkward
shapes."""

from __future__ import annotations

import pytest
import torch

from structlm.nn.factorized import shared_basis_macs
from structlm.share.compress import (
    LowRankLinear,
    OneSidedLinear,
    SharedBasis,
    SharedBasisLinear,
)

GEN = torch.Generator().manual_seed(7)


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def _shared(out: int, inn: int, k_out: int, k_in: int, bias: bool, residual: int = 0
            ) -> SharedBasisLinear:
    basis = SharedBasis(_r(k_in, inn), _r(out, k_out))
    res = (_r(out, residual), _r(residual, inn)) if residual else None
    return SharedBasisLinear(basis, _r(k_out, k_in), _r(out) if bias else None, res)


def _dense(mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    W = mod.dense_weight().detach().double()
    y = x.double() @ W.T
    return y if mod.bias is None else y + mod.bias.detach().double()


def test_macs_known_answer() -> None:
    # SmolLM2's MLP-in under shared at -20%: 3072 x 576, k_out 2394, k_in 485
    m = shared_basis_macs(1, 3072, 576, 2394, 485)
    assert m["chain"] == 576 * 485 + 485 * 2394 + 2394 * 3072
    assert m["merged"] == 3072 * 2394 * 485 + 576 * 485 + 485 * 3072
    assert shared_basis_macs(2048, 3072, 576, 2394, 485)["merged"] < \
        shared_basis_macs(2048, 3072, 576, 2394, 485)["chain"]
    assert shared_basis_macs(1, 3072, 576, 2394, 485)["chain"] < m["merged"]


@pytest.mark.parametrize("lead", [(1,), (7,), (97,), (1025,), (2, 3), (1, 1, 5)])
@pytest.mark.parametrize("shape", [(48, 40, 44, 9), (13, 29, 3, 11), (40, 7, 40, 7)])
@pytest.mark.parametrize("bias,residual", [(True, 0), (False, 0), (True, 3)])
def test_shared_basis_linear_matches_dense(lead: tuple[int, ...],
                                           shape: tuple[int, int, int, int],
                                           bias: bool, residual: int) -> None:
    out, inn, k_out, k_in = shape
    mod = _shared(out, inn, k_out, k_in, bias, residual)
    x = _r(*lead, inn)
    y = mod(x)
    assert y.shape == (*lead, out)
    torch.testing.assert_close(y.double(), _dense(mod, x), rtol=1e-4, atol=1e-3)


def test_both_orders_are_exercised_and_agree() -> None:
    mod = _shared(48, 40, 44, 9, True)
    one, many = _r(1, 40), _r(1025, 40)
    c1 = shared_basis_macs(1, 48, 40, 44, 9)
    cm = shared_basis_macs(1025, 48, 40, 44, 9)
    assert c1["chain"] < c1["merged"] and cm["merged"] < cm["chain"]  # both branches run
    x = torch.cat([one, many])
    rows = torch.cat([mod(one), mod(many)])
    torch.testing.assert_close(rows.double(), _dense(mod, x), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("tokens", [1, 1025])
def test_shared_basis_gradients_match_dense(tokens: int) -> None:
    mod = _shared(48, 40, 44, 9, True, residual=2)
    x = _r(tokens, 40)
    mod(x).pow(2).sum().backward()
    got = (mod.core.grad.clone(), mod.res_b.grad.clone(), mod.res_c.grad.clone())
    core, rb, rc = (t.detach().double().requires_grad_() for t in
                    (mod.core, mod.res_b, mod.res_c))
    U, P, b = mod.basis.U.double(), mod.basis.P.double(), mod.bias.double()
    (x.double() @ (U @ core @ P + rb @ rc).T + b).pow(2).sum().backward()
    for g, ref in zip(got, (core.grad, rb.grad, rc.grad), strict=True):
        # float32 sums over up to 1025 rows: the error scales with the gradient's size
        # (measured over 40 seeds: ≤ 1.3e-6 of its max-abs), not with each element's,
        # so an element near cancellation needs an absolute bound of that scale
        torch.testing.assert_close(g.double(), ref, rtol=1e-4,
                                   atol=1e-5 * float(ref.abs().max()))
    assert mod.basis.P.grad is None and mod.basis.U.grad is None  # the basis stays frozen


@pytest.mark.parametrize("tokens", [1, 1025])
def test_nan_stays_in_its_row(tokens: int) -> None:
    mods = [_shared(48, 40, 44, 9, True), LowRankLinear(_r(48, 5), _r(5, 40), _r(48)),
            OneSidedLinear(SharedBasis(_r(6, 40), None), _r(48, 6), None)]
    x = _r(tokens + 1, 40)
    x[0, 3] = float("nan")
    for mod in mods:
        y = mod(x)
        assert bool(y[0].isnan().all()) and bool(y[1:].isfinite().all())


@pytest.mark.parametrize("lead", [(1,), (97,), (2, 7)])
def test_low_rank_and_one_sided_match_dense(lead: tuple[int, ...]) -> None:
    for mod in (LowRankLinear(_r(31, 4), _r(4, 17), _r(31)),
                LowRankLinear(_r(31, 4), _r(4, 17), None),
                OneSidedLinear(SharedBasis(_r(6, 17), None), _r(31, 6), _r(31))):
        x = _r(*lead, 17)
        torch.testing.assert_close(mod(x).double(), _dense(mod, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dtypes(dtype: torch.dtype) -> None:
    mod = _shared(48, 40, 44, 9, True, residual=2)
    ref_x = _r(97, 40)
    ref = _dense(mod, ref_x)
    mod = mod.to(dtype)
    y = mod(ref_x.to(dtype))
    assert y.dtype == dtype
    tol = 0.05 if dtype is torch.bfloat16 else 1e-4
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))



@pytest.mark.parametrize("rows", [1, 3, 4])
def test_decode_calls_take_the_few_row_kernel_and_match_dense(rows: int) -> None:
    """At cached decode (few rows, no graph) the factor products run on the compiled
    few-row kernel (the path the original model's layers take in the benchmarks) and
    still equal the dense matrix; a NaN stays in its row."""
    from route_helpers import dense_on_kernel
    from structlm.ops import cpu_kernels

    if not cpu_kernels.fused_rows_available():
        pytest.skip("no C++ compiler: the rows kernel cannot be built")
    mods = [_shared(48, 40, 44, 9, True, residual=2), _shared(13, 29, 3, 11, False),
            LowRankLinear(_r(97, 7), _r(7, 40), _r(97)),
            OneSidedLinear(SharedBasis(_r(6, 40), None), _r(1025, 6), None)]
    for mod in mods:
        inn = mod.dense_weight().shape[1]
        x = _r(rows, 1, inn)  # leading dims
        with torch.no_grad():
            first = mod.basis.P if hasattr(mod, "basis") else mod.C
            assert dense_on_kernel(x, first)
            y = mod(x)
            torch.testing.assert_close(y.double(), _dense(mod, x), rtol=1e-4, atol=1e-3)
            x[0, 0, 1] = float("nan")
            y = mod(x)
        assert bool(y[0].isnan().all()) and bool(y[1:].isfinite().all())
