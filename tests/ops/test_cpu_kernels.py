"""The compiled CPU fused-rows kernel (decode) against the reference oracle.

Rule: ``err(fused-rows) <= 2 * err(reference in the same dtype)`` against float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from route_helpers import kernel_rows_per_type, layout_of
from structlm import AlgebraLinear, get_algebra, support_of
from structlm.ops import Backend, cpu_extension, cpu_kernels
from structlm.ops.route import DECODE_MAX_ROWS, force_layout

pytestmark = pytest.mark.skipif(not cpu_kernels.fused_rows_available(),
                                reason="no C++ compiler: the fused-rows kernel cannot be built")

ALGEBRAS = ["Q1", "Q4", "Q2^2", "Q2^3", "Q8", "graph:3:0-1,1-2,2-0", "Q2xQ3", "graph:4:"]


def _layer(algebra: str, unequal: bool) -> AlgebraLinear:
    q = support_of(get_algebra(algebra)).q
    if unequal:
        in_w = [3 + 5 * (i % 3) for i in range(q)]
        out_w = [7 - i % 4 for i in range(q)]
        return AlgebraLinear(sum(in_w), sum(out_w), algebra, group_sizes=(in_w, out_w))
    return AlgebraLinear(40 * q, 24 * q, algebra)


def _errors(layer: AlgebraLinear, x: torch.Tensor, types: torch.Tensor) -> tuple[float, float]:
    exact_layer = AlgebraLinear(layer.in_features, layer.out_features, layer.algebra_name,
                                group_sizes=(layer.in_widths, layer.out_widths),
                                dtype=torch.float64, backend="reference")
    with torch.no_grad():
        exact_layer.weight.copy_(layer.weight.double())
        exact = exact_layer(x.double(), types)
        layer.backend = Backend.REFERENCE
        plain = layer(x, types)
        layer.backend = Backend.BLOCKED
        with force_layout("fused-rows"):
            fast = layer(x, types)
    assert fast.dtype == x.dtype and fast.shape == exact.shape
    assert torch.isfinite(fast).all()
    return (fast.double() - exact).abs().max().item(), (plain.double() - exact).abs().max().item()


@pytest.mark.parametrize("algebra", ALGEBRAS)
@pytest.mark.parametrize("unequal", [False, True])
@pytest.mark.parametrize("m", [1, 7, 16, 97, 1025])  # 1025: three row blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_rows_matches_reference(algebra: str, unequal: bool, m: int,
                                      dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(hash((algebra, unequal, m)) % 2**31)
    torch.manual_seed(m)
    layer = _layer(algebra, unequal).to(dtype)
    x = torch.randn(m, layer.in_features, generator=gen).to(dtype)
    for types in (torch.randint(0, layer.q, (m,), generator=gen), torch.full((m,), layer.q - 1)):
        for copy in cpu_kernels.DECODE_COPIES:  # one type: typed or block copy; mixed: block
            with cpu_kernels.decode_copy(copy):
                err_fast, err_plain = _errors(layer, x, types)
            eps = torch.finfo(dtype).eps
            assert err_fast <= 2 * err_plain + 8 * eps * layer.in_features**0.5, (
                copy, err_fast, err_plain)


def test_fused_rows_long_rows_and_leading_dims() -> None:
    """A 1025-wide input (segments longer than the 32-lane unroll, with a tail) and
    leading batch dims (2, 3, 1), as a decode step of a batch would have."""
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    layer = AlgebraLinear(1025 * 4, 97 * 4, "Q2^2", bias=True)
    x = torch.randn(2, 3, 1, layer.in_features, generator=gen)
    for types in (torch.randint(0, 4, (2, 3, 1), generator=gen), torch.full((2, 3, 1), 1)):
        err_fast, err_plain = _errors(layer, x, types)  # mixed: block copy; one: typed
        assert err_fast <= 2 * err_plain + 8 * torch.finfo(torch.float32).eps * 4100**0.5


@pytest.mark.parametrize("algebra", ["Q2^2", "Q2^3", "Q4", "Q2xQ3"])
@pytest.mark.parametrize("width", [37, 2053])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_typed_copies_every_type_and_nan(algebra: str, width: int, dtype: torch.dtype) -> None:
    """Rows of one type from the typed copies, for every type: short rows read x in place
    as the segments of the blocks the type reads (adjacent ones merged, the others apart),
    rows of >= 2048 inputs read a gathered copy. A NaN in one input column reaches exactly
    the outputs whose blocks read that column, as in the reference."""
    q = support_of(get_algebra(algebra)).q
    gen = torch.Generator().manual_seed(width + q)
    torch.manual_seed(width)
    in_w = [width + 3 * i for i in range(q)]  # unequal groups; every row long at 2053
    out_w = [5 + i % 3 for i in range(q)]
    layer = AlgebraLinear(sum(in_w), sum(out_w), algebra, group_sizes=(in_w, out_w),
                          bias=True).to(dtype)
    col = in_w[0] + in_w[1] // 2  # a column of input group 1
    for a in range(q):
        types = torch.full((3,), a)
        x = torch.randn(3, layer.in_features, generator=gen).to(dtype)
        with cpu_kernels.decode_copy("typed"):
            err_fast, err_plain = _errors(layer, x, types)
        bound = 2 * err_plain + 8 * torch.finfo(dtype).eps * layer.in_features**0.5
        assert err_fast <= bound, (a, err_fast, err_plain)
        x[1, col] = float("nan")
        with torch.no_grad():
            layer.backend = Backend.REFERENCE
            want = layer(x, types).isnan()
            layer.backend = Backend.BLOCKED
            with cpu_kernels.decode_copy("typed"), force_layout("fused-rows"):
                got = layer(x, types).isnan()
        assert want[1].any() == bool(layer.plan.type_blocks[a, 1].any()), a  # reads group 1?
        assert torch.equal(got, want), a


def test_fused_rows_bf16_falls_back_to_rectangles() -> None:
    """bf16 is not compiled: the layout runs the PyTorch rectangles instead, still exact."""
    gen = torch.Generator().manual_seed(9)
    layer = _layer("Q2^2", unequal=True).to(torch.bfloat16)
    x = torch.randn(1, layer.in_features, generator=gen).to(torch.bfloat16)
    err_fast, err_plain = _errors(layer, x, torch.tensor([2]))
    assert err_fast <= 2 * err_plain + 1e-6


def test_fused_rows_is_chosen_for_cpu_decode_and_grads_flow() -> None:
    layer = AlgebraLinear(64, 32, "Q2^2")
    one = torch.tensor([3])
    assert layout_of(layer.plan, layer.partition(one), torch.randn(1, 64),
                         layer.weight.detach()) == "fused-rows"
    many = torch.arange(kernel_rows_per_type(torch.float32) * layer.q + 1) % 4
    assert layout_of(layer.plan, layer.partition(many), torch.randn(len(many), 64),
                         layer.weight.detach()) != "fused-rows"
    x = torch.randn(1, 64, requires_grad=True)  # training through it: diag-first backward
    layer(x, one).sum().backward()
    dense = layer.to_dense(3)  # (out, in) effective weight of type 3
    torch.testing.assert_close(x.grad, dense.sum(0, keepdim=True), rtol=1e-5, atol=1e-5)


def test_block_tables_and_packing() -> None:
    layer = AlgebraLinear(8, 12, "Q4")  # type a reads groups d and a for output group d
    out_off, in_off, uses = cpu_kernels.block_tables(layer.plan)
    assert out_off.tolist() == [0, 3, 6, 9, 12] and in_off.tolist() == [0, 2, 4, 6, 8]
    q = 4
    groups = {(a, d): torch.nonzero(uses[a, d]).flatten().tolist()
              for a in range(q) for d in range(q)}
    assert groups[(1, 1)] == [1]  # the diagonal block only
    assert groups[(1, 2)] == [1, 2]
    assert groups[(0, 3)] == [0, 3]
    w = layer.weight.detach()
    packed = cpu_kernels.pack_blocks(w, layer.plan)
    # output group 2 (rows 6:9, one strip of 3 rows) at element 6 * 8, stored transposed
    assert torch.equal(packed[6 * 8:9 * 8].view(8, 3), w[6:9].t())
    # groups of more rows than a strip: strips of 16 rows, then the rest, group by group
    big = AlgebraLinear(6, 2 * 37, "Q2")  # groups of 37 rows: strips 16, 16, 5
    wb = big.weight.detach()
    pb = cpu_kernels.pack_blocks(wb, big.plan)
    assert pb.numel() == wb.numel()
    for n0, rows in ((0, 16), (16, 16), (32, 5), (37, 16), (53, 16), (69, 5)):
        assert torch.equal(pb[n0 * 6:(n0 + rows) * 6].view(6, rows), wb[n0:n0 + rows].t())
    assert cpu_kernels.packed_weight(w, layer.plan) is cpu_kernels.packed_weight(w, layer.plan)
    # typed copies: type after type, group after group, each row its blocks back to back
    typed = cpu_kernels.pack_types(w, layer.plan)
    pos = 0
    for a in range(q):
        for d in range(q):
            rows = w[3 * d:3 * d + 3]
            want = torch.cat([rows[:, 2 * b:2 * b + 2] for b in groups[(a, d)]], dim=1)
            assert torch.equal(typed[pos:pos + want.numel()].view_as(want), want)
            pos += want.numel()
    assert pos == typed.numel() == sum(3 * 2 * len(g) for g in groups.values())
    assert cpu_kernels.typed_weight(w, layer.plan) is cpu_kernels.typed_weight(w, layer.plan)


def test_packed_copy_follows_in_place_updates() -> None:
    """An optimizer step (or a ``.data`` swap) between decode calls must not leave a stale
    weight copy."""
    gen = torch.Generator().manual_seed(4)
    layer = AlgebraLinear(16, 8, "Q2^2")
    x, one = torch.randn(1, 16, generator=gen), torch.tensor([2])
    for copy in cpu_kernels.DECODE_COPIES:
        with torch.no_grad(), cpu_kernels.decode_copy(copy):
            before = layer(x, one)
            layer.weight.mul_(2.0)  # in place: bumps the weight's version
            after = layer(x, one)
            torch.testing.assert_close(after, 2 * before)
            layer.weight.data = -layer.weight.data.clone()  # swapped: the version stays
            torch.testing.assert_close(layer(x, one), -after)


def test_kernel_rejects_bad_input() -> None:
    layer = AlgebraLinear(8, 8, "Q4")
    part = layer.partition(torch.tensor([0]))
    with pytest.raises(TypeError, match="dtype"):
        cpu_kernels.fused_rows_linear(torch.randn(1, 8, dtype=torch.float64),
                                      layer.weight.detach(), layer.plan, part)
    with pytest.raises(ValueError, match="do not fit the plan"):
        cpu_kernels.fused_rows_linear(torch.randn(1, 9), layer.weight.detach(), layer.plan, part)
    mod, tables = cpu_extension.extension(), cpu_kernels.block_tables(layer.plan)
    typed = cpu_kernels.typed_weight(layer.weight.detach(), layer.plan)
    with pytest.raises(RuntimeError, match="every row must have one type"):
        mod.typed_rows_forward(torch.randn(2, 8), typed, torch.tensor([0, 1]), *tables, 4, None)
    with pytest.raises(RuntimeError, match="type 4 outside"):
        mod.typed_rows_forward(torch.randn(1, 8), typed, torch.tensor([4]), *tables, 4, None)
    with pytest.raises(RuntimeError, match="type -1 outside"):
        mod.fused_rows_forward(torch.randn(1, 8), cpu_kernels.pack_blocks(
            layer.weight.detach(), layer.plan), torch.tensor([-1]), *tables, 4, None)
    with pytest.raises(RuntimeError, match="contiguous weight of"):
        mod.typed_rows_forward(torch.randn(1, 8), typed[:-1], torch.tensor([0]), *tables, 4,
                               None)
    with pytest.raises(ValueError, match="unknown decode copy"):
        with cpu_kernels.decode_copy("rows"):
            pass


def test_build_failure_warns_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    def broken(**_: object) -> None:
        raise OSError("no compiler here")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(cpu_extension, "_STATE", {})
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        assert not cpu_kernels.fused_rows_available()
    layer = AlgebraLinear(8, 8, "Q2^2")
    assert layout_of(layer.plan, layer.partition(torch.tensor([1])), torch.randn(1, 8),
                         layer.weight.detach()) == "output-major"
    monkeypatch.setattr(cpu_extension, "_STATE", {})
    monkeypatch.setenv("STRUCTLM_CPU_KERNELS", "0")
    assert not cpu_kernels.fused_rows_available()  # disabled: no build, no warning


def test_stale_build_lock_is_removed(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupted build leaves a lock torch would wait on forever; an old one goes."""
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    path = cpu_extension.build_directory("x")
    assert path == tmp_path / "structlm" / "x"
    lock = path / "lock"
    lock.touch()
    cpu_extension.build_directory("x")
    assert lock.exists()  # fresh: another process may be building right now
    old = time.time() - 2 * cpu_extension._STALE_LOCK_S
    os.utime(lock, (old, old))
    cpu_extension.build_directory("x")
    assert not lock.exists()


@pytest.mark.parametrize("algebra", ["dense", "Q4", "Q2^2", "Q2xQ3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_swiglu_rows_matches_three_reference_layers(algebra: str, dtype: torch.dtype) -> None:
    """The decode FFN in one call equals down(silu(gate(x)) * up(x)) on the reference."""
    gen = torch.Generator().manual_seed(len(algebra) + 17)
    d, f = 12 * 9, 12 * 23  # 108 -> 276: widths that are not multiples of the SIMD width
    for rows in (1, 3, DECODE_MAX_ROWS):
        x = torch.randn(rows, d, generator=gen, dtype=torch.float64)
        if algebra == "dense":
            ws = [torch.randn(o, i, generator=gen, dtype=torch.float64) / i**0.5
                  for i, o in ((d, f), (d, f), (f, d))]
            exact = F.linear(F.silu(F.linear(x, ws[0])) * F.linear(x, ws[1]), ws[2])
            plain = F.linear(F.silu(F.linear(x.to(dtype), ws[0].to(dtype)))
                             * F.linear(x.to(dtype), ws[1].to(dtype)), ws[2].to(dtype))
            fast = cpu_kernels.swiglu_rows(x.to(dtype), *(w.to(dtype) for w in ws))
        else:
            layers = [AlgebraLinear(i, o, algebra, dtype=torch.float64, backend="reference")
                      for i, o in ((d, f), (d, f), (f, d))]
            types = torch.randint(0, layers[0].q, (rows,), generator=gen)
            if rows == 3:  # one type for all rows: the typed copies
                types = torch.full((rows,), layers[0].q - 1)
            with torch.no_grad():
                g, u, dn = layers
                exact = dn(F.silu(g(x, types)) * u(x, types), types)
                low = [layer.to(dtype) for layer in layers]
                xl = x.to(dtype)
                plain = low[2](F.silu(low[0](xl, types)) * low[1](xl, types), types)
                part = low[0].partition(types)
                fast = cpu_kernels.swiglu_rows(xl, *(layer.weight for layer in low),
                                               (low[0].plan, low[2].plan), part)
        assert fast.dtype == dtype and fast.shape == (rows, d)
        err_fast = (fast.double() - exact).abs().max().item()
        err_plain = (plain.double() - exact).abs().max().item()
        assert err_fast <= 2 * err_plain + 4 * torch.finfo(dtype).eps * f, (err_fast, err_plain)


@pytest.mark.parametrize("train_weight", [True, False])
@pytest.mark.parametrize("algebra", ["Q8", "Q2^2"])
def test_batch_of_32_with_a_graph_equals_the_reference(algebra: str, train_weight: bool
                                                       ) -> None:
    """M = 32 with a graph: a trained weight runs PyTorch layouts both ways (its packed
    copy would be rebuilt every step); a frozen one runs the kernel forward and a PyTorch
    layout's input gradient. Outputs and gradients equal the reference (float64)."""
    gen = torch.Generator().manual_seed(5)
    layer = AlgebraLinear(8 * 7, 8 * 5, algebra, dtype=torch.float64)
    ref = AlgebraLinear(8 * 7, 8 * 5, algebra, dtype=torch.float64, backend="reference")
    ref.load_state_dict(layer.state_dict())
    for lin in (layer, ref):
        lin.weight.requires_grad_(train_weight)
    types = torch.arange(32) % layer.q
    x = torch.randn(32, 56, generator=gen, dtype=torch.float64)
    g = torch.randn(32, 40, generator=gen, dtype=torch.float64)
    calls = []
    original = cpu_kernels.fused_rows_linear
    outs = []
    try:
        cpu_kernels.fused_rows_linear = lambda *a, **k: calls.append(1) or original(*a, **k)
        for lin in (layer, ref):
            xi = x.clone().requires_grad_(True)
            y = lin(xi, lin.partition(types) if lin is layer else types)
            y.backward(g)
            outs.append((y.detach(), xi.grad, lin.weight.grad))
    finally:
        cpu_kernels.fused_rows_linear = original
    assert bool(calls) == (not train_weight and cpu_kernels.fused_rows_available())
    for a, b in zip(*outs, strict=True):
        if a is None or b is None:
            assert a is None and b is None and not train_weight
        else:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _dense_rows_errors(gen: torch.Generator, n: int, k: int, rows: int, dtype: torch.dtype,
                       packed: bool, bias: bool = True) -> tuple[torch.Tensor, float, float]:
    """A random ``(n, k)`` weight (and bias) and ``rows`` inputs: the weight, and the
    largest error of the few-row kernel and of ``F.linear`` in ``dtype`` against the
    float64 product."""
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) / k**0.5
    b = torch.randn(n, generator=gen, dtype=torch.float64) if bias else None
    x = torch.randn(rows, k, generator=gen, dtype=torch.float64)
    low = None if b is None else b.to(dtype)
    exact = F.linear(x, w, b)
    plain = F.linear(x.to(dtype), w.to(dtype), low)
    fast = cpu_kernels.dense_rows_linear(x.to(dtype), w.to(dtype), low, packed=packed)
    return (w, (fast.double() - exact).abs().max().item(),
            (plain.double() - exact).abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_packed_rows_every_row_count_of_a_panel_call(dtype: torch.dtype) -> None:
    """The packed few-row kernel takes rows four (eight with AVX-512) at a time against
    a panel, and with AVX-512 six at a time against two full panels: every row count
    1..17 (each remainder of a call), full and narrow panels (N = 53 = 3 × 16 + 5: a pair,
    a lone full strip, a narrow one; 100 = 6 × 16 + 4: pairs) and an odd K, NaN propagated row
    by row, against a float64 product."""
    gen = torch.Generator().manual_seed(29)
    k = 37
    for n, rows in [(53, r) for r in range(1, 18)] + [(100, 13), (100, 6)]:
        w, err_fast, err_plain = _dense_rows_errors(gen, n, k, rows, dtype, packed=True)
        bound = 2 * err_plain + 4 * torch.finfo(dtype).eps * k
        assert err_fast <= bound, (n, rows, err_fast)
    x = torch.randn(9, k, generator=gen).to(dtype)
    x[5, 3] = float("nan")
    y = cpu_kernels.dense_rows_linear(x, w.to(dtype), packed=True)
    assert torch.isnan(y[5]).all() and torch.isfinite(torch.cat([y[:5], y[6:]])).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_rows_long_inputs_many_rows(dtype: torch.dtype) -> None:
    """The packed kernel at more rows than one panel call takes (several groups of six
    and eight against each strip pair, then the rest): inputs 255, 256, 257 and 1025 wide,
    8, 9, 32 and 33 rows, a dense weight and an algebra layer of mixed types with 300-wide
    blocks, NaN kept to its row."""
    gen = torch.Generator().manual_seed(31)
    n = 53
    for k, rows in [(k, r) for k in (255, 256, 257, 1025) for r in (8, 9, 32, 33)]:
        w, err_fast, err_plain = _dense_rows_errors(gen, n, k, rows, dtype, packed=True)
        assert err_fast <= 2 * err_plain + 4 * torch.finfo(dtype).eps * k, (k, rows, err_fast)
    x = torch.randn(33, 1025, generator=gen).to(dtype)
    x[20, 700] = float("nan")
    y = cpu_kernels.dense_rows_linear(x, w.to(dtype), packed=True)
    assert torch.isnan(y[20]).all() and torch.isfinite(torch.cat([y[:20], y[21:]])).all()
    layer = AlgebraLinear(4 * 300, 4 * 40, "Q2^2").to(dtype)
    for rows in (9, 33):
        xa = torch.randn(rows, layer.in_features, generator=gen).to(dtype)
        types = torch.randint(0, 4, (rows,), generator=gen)
        err_fast, err_plain = _errors(layer, xa, types)
        assert err_fast <= 2 * err_plain + 8 * torch.finfo(dtype).eps * 1200**0.5, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_rows_in_place_both_row_loops(dtype: torch.dtype) -> None:
    """The in-place few-row loop takes rows of at least 2048 inputs four at a time and
    shorter ones one at a time: inputs on both sides (2047, 2048, 2053), output counts
    that leave 1-3 rows after the groups of four (N = 13, 6), 1 and 3 rows, NaN kept to
    its row, against a float64 product."""
    gen = torch.Generator().manual_seed(41)
    for k, n, rows in [(2047, 13, 1), (2048, 13, 3), (2053, 6, 1), (2053, 13, 3)]:
        w, err_fast, err_plain = _dense_rows_errors(gen, n, k, rows, dtype, packed=False,
                                                    bias=False)
        assert err_fast <= 2 * err_plain + 4 * torch.finfo(dtype).eps * k, (k, n, rows)
    x = torch.randn(3, 2053, generator=gen).to(dtype)
    x[1, 2050] = float("nan")  # in the tail after the last full vector
    y = cpu_kernels.dense_rows_linear(x, w.to(dtype), packed=False)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m", [31 * 3, 32 * 3, 1025, 1537])
def test_many_rows_row_blocks_and_types_in_turn(dtype: torch.dtype, m: int) -> None:
    """Batches past one row block (512 rows, cut at type boundaries) and with 32 or more
    rows per type present (float32 with AVX-512: each type's rows against all its blocks
    of a strip pair per call, stored straight into the output; 31 per type: block by
    block): unequal groups whose strips end in narrow ones, a random bias, one type absent,
    against the float64 reference; a NaN input reaches exactly the outputs that read it."""
    gen = torch.Generator().manual_seed(m)
    in_w, out_w = [40, 72, 24, 64], [48, 40, 37, 64]  # 40 = 32 + 8, 37 = 32 + 5: narrow strips
    kw = dict(group_sizes=(in_w, out_w), bias=True)
    layer = AlgebraLinear(sum(in_w), sum(out_w), "Q2^2", **kw).to(dtype)
    exact = AlgebraLinear(sum(in_w), sum(out_w), "Q2^2", backend="reference", dtype=torch.float64,
                          **kw)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen))
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))
        exact.weight.copy_(layer.weight.double())
        exact.bias.copy_(layer.bias.double())
    types = torch.randint(0, 3, (m,), generator=gen)  # type 3 absent
    if m in (31 * 3, 32 * 3):  # exactly 31 / 32 rows of each present type
        types = torch.arange(m) % 3
    x = torch.randn(m, layer.in_features, generator=gen).to(dtype)
    with torch.no_grad(), force_layout("fused-rows"):
        fast = layer(x, types)
        want = exact(x.double(), types)
        x[m // 2, 7] = float("nan")
        y_nan, want_nan = layer(x, types), exact(x.double(), types)
    err = (fast.double() - want).abs().max().item()
    assert err <= 64 * torch.finfo(dtype).eps * sum(in_w) ** 0.5 * want.abs().max().item(), err
    # NaN exactly where the reference has it: the outputs whose blocks read input 7
    assert torch.isnan(y_nan[m // 2]).any()
    assert torch.equal(torch.isnan(y_nan), torch.isnan(want_nan))


@pytest.mark.parametrize(("algebra", "m", "one_type"), [
    ("Q1", 1100, False),    # a dense weight past one row block
    ("Q4", 1025, False),    # type by type, several row blocks
    ("Q16", 1025, False),   # 64 rows per type: type by type
    ("Q32", 700, False),    # ~22 rows per type: block by block, two row blocks
    ("Q2^2", 1025, True),   # one type, many rows: the panel-packed copy, not the typed one
])
@pytest.mark.parametrize("threads", [1, 3])
def test_many_rows_every_path(algebra: str, m: int, one_type: bool, threads: int) -> None:
    """Every loop of the panel kernel at many rows, on output groups of 64 rows (two strip
    pairs; split over 3 threads some strips are left single and go block by block inside
    a type-by-type row block), float32 with a bias, against the float64 reference."""
    gen = torch.Generator().manual_seed(m + threads)
    q = support_of(get_algebra(algebra)).q
    k, n = 48 * q, 64 * q
    layer = AlgebraLinear(k, n, algebra, bias=True)
    exact = AlgebraLinear(k, n, algebra, bias=True, backend="reference", dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen))
        layer.bias.copy_(torch.randn(n, generator=gen))
        exact.weight.copy_(layer.weight.double())
        exact.bias.copy_(layer.bias.double())
    types = (torch.full((m,), q - 1) if one_type else
             torch.randint(0, q, (m,), generator=gen))
    x = torch.randn(m, k, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad(), force_layout("fused-rows"):
            fast = layer(x, types)
    finally:
        torch.set_num_threads(before)
    with torch.no_grad():
        want = exact(x.double(), types)
    err = (fast.double() - want).abs().max().item()
    assert err <= 64 * torch.finfo(torch.float32).eps * k**0.5 * want.abs().max().item(), err
    if one_type:
        assert not cpu_kernels.uses_typed_copy(layer.partition(types))
