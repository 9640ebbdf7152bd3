"""The blocked backend against the reference oracle: forward, dX and dW.

Rule (flash-attention's): ``err(blocked) <= 2 * err(reference in the same dtype)``
against a float64 reference computed from the same rounded inputs.
"""

from __future__ import annotations

import pytest
import torch

from route_helpers import kernel_rows_per_type, layout_of
from structlm import AlgebraLinear, get_algebra, support_of
from structlm.ops import Backend, cpu_kernels
from structlm.ops.route import force_layout, gathered_applies

ALGEBRAS = ["Q1", "Q2", "Q4", "Q2^2", "Q8", "graph:3:0-1,1-2,2-0", "Q2xQ3", "graph:4:"]


def _types(kind: str, m: int, q: int, gen: torch.Generator) -> torch.Tensor:
    p = torch.arange(m)
    if kind == "cyclic":
        return p % q
    if kind == "block":
        return (p // 5) % q
    if kind == "single":
        return torch.full((m,), q - 1)
    return torch.randint(0, q, (m,), generator=gen)


def _run(layer: AlgebraLinear, x: torch.Tensor, types: torch.Tensor, g: torch.Tensor,
         backend: str) -> tuple[torch.Tensor, ...]:
    layer.backend = Backend(backend)
    x = x.detach().clone().requires_grad_(True)
    y = layer(x, types)
    dx, dw = torch.autograd.grad(y, [x, layer.weight], g)
    return y.detach(), dx, dw


def _check(layer: AlgebraLinear, x: torch.Tensor, types: torch.Tensor, dtype: torch.dtype,
           gen: torch.Generator) -> None:
    layer = layer.to(dtype)
    xd = x.to(dtype)
    out_shape = (*x.shape[:-1], layer.out_features)
    g = torch.randn(out_shape, generator=gen).to(dtype)
    fast = _run(layer, xd, types, g, "blocked")
    plain = _run(layer, xd, types, g, "reference")
    ref_layer = AlgebraLinear(layer.in_features, layer.out_features, layer.algebra_name,
                              group_sizes=(layer.in_widths, layer.out_widths), dtype=torch.float64)
    with torch.no_grad():
        ref_layer.weight.copy_(layer.weight.double())
    exact = _run(ref_layer, xd.double(), types, g.double(), "reference")
    eps = torch.finfo(dtype).eps
    # floor for when the plain path happens to be exact (float64): rounding of a
    # reduction of length n is O(eps * sqrt(n)) relative to the output scale
    n_red = max(x.numel() // x.shape[-1], layer.in_features, layer.out_features)
    for name, f, p, e in zip(("y", "dx", "dw"), fast, plain, exact, strict=False):
        assert f.dtype == dtype and f.shape == e.shape, name
        assert torch.isfinite(f).all(), name
        err_fast = (f.double() - e).abs().max().item()
        err_plain = (p.double() - e).abs().max().item()
        scale = e.abs().max().item() + 1e-30
        bound = 2 * err_plain + 8 * eps * scale * n_red**0.5
        assert err_fast <= bound, (name, err_fast, err_plain, scale)


@pytest.mark.parametrize("algebra", ALGEBRAS)
@pytest.mark.parametrize("kind", ["cyclic", "block", "random", "single"])
@pytest.mark.parametrize("m", [1, 7, 97])
def test_fp64_equal_widths(algebra: str, kind: str, m: int) -> None:
    gen = torch.Generator().manual_seed(hash((algebra, kind, m)) % 2**31)
    torch.manual_seed(m)
    q = support_of(get_algebra(algebra)).q
    layer = AlgebraLinear(5 * q, 3 * q, algebra)
    x = torch.randn(m, 5 * q, generator=gen)
    _check(layer, x, _types(kind, m, q, gen), torch.float64, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("algebra", ["Q4", "Q2^2", "graph:3:0-1,1-2,2-0"])
def test_dtypes_m1025_unequal_widths(dtype: torch.dtype, algebra: str) -> None:
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(0)
    q = support_of(get_algebra(algebra)).q
    in_w = [3 + 2 * i for i in range(q)]
    out_w = [7 - i % 3 for i in range(q)]
    layer = AlgebraLinear(sum(in_w), sum(out_w), algebra, group_sizes=(in_w, out_w))
    x = torch.randn(1025, sum(in_w), generator=gen)
    for kind in ("cyclic", "random"):
        _check(layer, x, _types(kind, 1025, q, gen), dtype, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["cyclic", "block", "random"])
def test_leading_batch_dims(dtype: torch.dtype, kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(1)
    layer = AlgebraLinear(32, 16, "Q4", bias=True)
    x = torch.randn(3, 2, 20, 32, generator=gen)
    pos = torch.arange(20)
    t = {"cyclic": pos % 4, "block": (pos // 3) % 4}.get(kind)
    types = t.expand(3, 2, 20) if t is not None else torch.randint(0, 4, (3, 2, 20), generator=gen)
    _check(layer, x, types, dtype, gen)


@pytest.mark.parametrize("q", [4, 8, 16])
@pytest.mark.parametrize("rows_per_type", [1, 3, 16])
def test_gathered_layout(q: int, rows_per_type: int) -> None:
    """Balanced small batches take the row-first gathered path; check it and its grads."""
    gen = torch.Generator().manual_seed(q * 100 + rows_per_type)
    torch.manual_seed(q)
    layer = AlgebraLinear(4 * q, 2 * q, f"Q{q}")
    m = q * rows_per_type
    for types in (torch.arange(m) % q, torch.randperm(m, generator=gen) % q):
        assert gathered_applies(layer.plan, layer.partition(types))
        x = torch.randn(m, 4 * q, generator=gen)
        _check(layer, x, types, torch.float32, gen)


def test_q1_equals_linear() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(13, 9)
    layer = AlgebraLinear.from_linear(lin, "Q1")
    x = torch.randn(4, 6, 13)
    types = torch.zeros(4, 6, dtype=torch.long)
    for backend in ("reference", "blocked"):
        layer.backend = Backend(backend)
        torch.testing.assert_close(layer(x, types), lin(x), rtol=1e-6, atol=1e-6)


def test_empty_batch() -> None:
    layer = AlgebraLinear(8, 8, "Q2")
    y = layer(torch.randn(0, 8), torch.zeros(0, dtype=torch.long))
    assert y.shape == (0, 8)


def test_weight_grad_reaches_only_active_blocks() -> None:
    torch.manual_seed(0)
    layer = AlgebraLinear(8, 8, "Q4")
    x = torch.randn(5, 8)
    y = layer(x, torch.full((5,), 2))
    y.sum().backward()
    g = layer.weight.grad
    active = layer.to_dense(2) != 0
    assert (g[~active] == 0).all() and (g[active] != 0).all()


@pytest.mark.parametrize("layout", ["diag-first", "block-major", "output-major", "fused-rows"])
@pytest.mark.parametrize("algebra", ["Q4", "Q2^2", "Q2^3", "graph:4:0-1,1-2,2-3,0-3", "Q2xQ3"])
@pytest.mark.parametrize("kind", ["cyclic", "random", "single"])
def test_every_layout_on_every_plan(layout: str, algebra: str, kind: str) -> None:
    """Each general layout is exact on every support, not only where it is chosen."""
    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(2)
    q = support_of(get_algebra(algebra)).q
    in_w = [2 + (i % 3) for i in range(q)]
    out_w = [3 + (i % 2) for i in range(q)]
    layer = AlgebraLinear(sum(in_w), sum(out_w), algebra, group_sizes=(in_w, out_w))
    types = _types(kind, 97, q, gen)
    if layout == "fused-rows" and not cpu_kernels.fused_rows_available():
        pytest.skip("no C++ compiler: the fused-rows kernel cannot be built")
    with force_layout(layout):
        assert layout_of(layer.plan, layer.partition(types), _x(layer, 97),
                             layer.weight.detach()) == layout
        _check(layer, torch.randn(97, sum(in_w), generator=gen), types, torch.float64, gen)


def _x(layer: AlgebraLinear, rows: int) -> torch.Tensor:
    return torch.randn(rows, layer.in_features)


def test_layout_choice() -> None:
    cyc = torch.arange(32)
    q4, q22, q2 = (AlgebraLinear(16, 16, a) for a in ("Q4", "Q2^2", "Q2"))
    kernel = cpu_kernels.fused_rows_available()

    def choose(layer: AlgebraLinear, types: torch.Tensor, graph: bool = False) -> str:
        w = layer.weight if graph else layer.weight.detach()  # graph: no kernel
        return layout_of(layer.plan, layer.partition(types), _x(layer, len(types)), w)

    # up to kernel_max_rows_per_type q rows (per type on average) the compiled kernel,
    # where it applies
    per = kernel_rows_per_type(torch.float32)
    assert choose(q4, cyc % 4) == ("fused-rows" if kernel else "gathered")
    assert choose(q4, cyc % 4, graph=True) == "gathered"
    assert choose(q4, torch.arange(4 * per) % 4) == ("fused-rows" if kernel else "diag-first")
    assert choose(q4, torch.arange(4 * per + 1) % 4) == "diag-first"
    assert choose(q4, torch.arange(65) % 4, graph=True) == "diag-first"
    assert choose(q22, cyc % 4) == ("fused-rows" if kernel else "block-major")
    assert choose(q22, cyc % 4, graph=True) == "block-major"
    assert choose(q2, torch.arange(2 * per) % 2) == ("fused-rows" if kernel else "diag-first")
    assert choose(q2, torch.arange(2 * per + 1) % 2) == "diag-first"
    one = torch.zeros(1, dtype=torch.long)  # a decode step at batch 1
    assert choose(q22, one) == ("fused-rows" if kernel else "output-major")
    assert choose(q22, one.expand(17), graph=True) == "output-major"
    assert choose(q22, one.expand(65), graph=True) == "diag-first"
    # from 1024 rows of several types, narrow input groups (4 columns here): output-major's
    # rectangles merge them into deeper GEMMs; wide groups keep block-major
    assert choose(q22, torch.arange(1023) % 4, graph=True) == "block-major"
    assert choose(q22, torch.arange(1024) % 4, graph=True) == "output-major"
    assert choose(q22, (torch.arange(4096) // 32) % 4, graph=True) == "output-major"
    wide = AlgebraLinear(2048, 64, "Q2^2")  # input groups of 512 columns
    assert choose(wide, torch.arange(1024) % 4, graph=True) == "block-major"
    with pytest.raises(ValueError, match="unknown layout"), force_layout("fused"):
        pass


@pytest.mark.parametrize("algebra", ["Q2^2", "Q2^3", "Q2xQ3"])
@pytest.mark.parametrize("m", [7, 1025])
def test_block_major_with_an_absent_type_and_unequal_counts(algebra: str, m: int) -> None:
    """Block-major sorts the rows by type: exact when one type has no rows, the counts
    differ, and the shared blocks' rows split into several sorted ranges."""
    gen = torch.Generator().manual_seed(m)
    q = support_of(get_algebra(algebra)).q
    in_w = [2 + (i % 3) for i in range(q)]
    out_w = [3 + (i % 2) for i in range(q)]
    layer = AlgebraLinear(sum(in_w), sum(out_w), algebra, group_sizes=(in_w, out_w))
    types = torch.randint(1, q, (m,), generator=gen)  # type 0 absent
    types[: m // 2] = torch.where(types[: m // 2] == 1, 2, types[: m // 2])  # unequal
    with force_layout("block-major"):
        for dtype in (torch.float64, torch.float32):
            _check(layer, torch.randn(m, sum(in_w), generator=gen), types, dtype, gen)


def test_type_sorted_rows_round_trip_and_ranges() -> None:
    """Sorting by type is a permutation (unsort inverts it), each type's rows are one
    range, a type set's ranges hold exactly its rows, and rows already in order are not
    copied."""
    from structlm.ops.partition import TypePartition
    from structlm.ops.plan import make_plan

    gen = torch.Generator().manual_seed(5)
    types = torch.randint(0, 4, (97,), generator=gen)
    part = TypePartition(types, 4)
    plan = make_plan(support_of(get_algebra("Q2^2")), [2] * 4, [3] * 4)
    order = plan.sorted_type_order
    rows = part.type_sorted(order)
    x = torch.randn(97, 5, generator=gen)
    xs = rows.sort(x)
    torch.testing.assert_close(rows.unsort(xs), x, rtol=0, atol=0)
    sorted_types = rows.sort(types[:, None])[:, 0]
    assert [int(t) for t in sorted_types.unique_consecutive()] == [
        a for a in order if part.counts[a]]
    for *_, ts in plan.shared_runs:
        got = torch.cat([torch.arange(a, b) for a, b in rows.ranges(ts)])
        assert sorted(int(t) for t in sorted_types[got]) == sorted(
            int(t) for t in types if int(t) in ts)
    # Q2^2's four shared pairs form the cycle 0-1-3-2-0: at most one pair splits in two
    pairs = {ts for *_, ts in plan.shared_runs if len(ts) == 2}
    assert sum(len(rows.ranges(ts)) for ts in pairs) <= len(pairs) + 1
    contiguous = TypePartition(torch.arange(12) // 3, 4).type_sorted((0, 1, 2, 3))
    head = x[:12]
    assert contiguous.perm is None and contiguous.sort(head) is head
    with pytest.raises(ValueError, match="not a permutation"):
        part.type_sorted((0, 1, 1, 2))
