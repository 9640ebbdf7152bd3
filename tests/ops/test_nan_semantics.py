"""NaN semantics: every path follows the reference, whose sum runs over the support only
(a NaN in an input group a type does not use stays out of that type's outputs)."""

from __future__ import annotations

import pytest
import torch

from route_helpers import layout_of
from structlm import AlgebraLinear, get_algebra, support_of
from structlm.ops import Backend, cpu_kernels
from structlm.ops.route import force_layout

LAYOUTS = ["diag-first", "block-major", "output-major", "fused-rows", "gathered"]


def _layer(algebra: str, equal: bool) -> AlgebraLinear:
    torch.manual_seed(0)
    q = support_of(get_algebra(algebra)).q
    if equal:
        return AlgebraLinear(4 * q, 3 * q, algebra, dtype=torch.float64)
    in_w, out_w = [2 + (i % 3) for i in range(q)], [3 + (i % 2) for i in range(q)]
    return AlgebraLinear(sum(in_w), sum(out_w), algebra, group_sizes=(in_w, out_w),
                         dtype=torch.float64)


@pytest.mark.parametrize("algebra", ["Q2", "Q4", "Q2^2", "graph:4:0-1,1-2"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_nan_group_reaches_exactly_the_outputs_the_support_says(algebra: str,
                                                                  layout: str) -> None:
    layer = _layer(algebra, equal=layout == "gathered")
    q, mask = layer.q, layer.support.mask
    m = 8 * q  # every type, balanced (the gathered layout needs it)
    types = torch.arange(m) % q
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, layer.in_features, generator=gen, dtype=torch.float64)
    io = [0, *torch.tensor(layer.in_widths).cumsum(0).tolist()]
    oo = [0, *torch.tensor(layer.out_widths).cumsum(0).tolist()]
    beta = q - 1
    x[:, io[beta]] = float("nan")  # group beta of every row
    layer.backend = Backend.REFERENCE
    ref = layer(x, types)
    # the definition: row of type alpha gets NaN in output group delta iff S[alpha, beta, delta]
    for r in range(m):
        for d in range(q):
            want = bool(mask[int(types[r]), beta, d])
            assert bool(ref[r, oo[d]:oo[d + 1]].isnan().all()) == want
            assert bool(ref[r, oo[d]:oo[d + 1]].isnan().any()) == want
    if layout == "fused-rows" and not cpu_kernels.fused_rows_available():
        pytest.skip("no C++ compiler: the fused-rows kernel cannot be built")
    layer.backend = Backend.BLOCKED
    with force_layout(layout):
        if layout_of(layer.plan, layer.partition(types), x.detach(),
                         layer.weight.detach()) != layout:
            pytest.skip(f"{layout} does not apply to {algebra}")
        fast = layer(x, types)
    assert torch.equal(fast.isnan(), ref.isnan())
    ok = ~ref.isnan()
    torch.testing.assert_close(fast[ok], ref[ok])


def test_a_nan_in_a_dead_weight_block_stays_dead() -> None:
    """graph algebras keep blocks no type uses: NaN there reaches no output."""
    layer = _layer("graph:4:0-1,1-2", equal=True)
    used = torch.as_tensor(layer.support.used_blocks)
    dead = (~used).nonzero()
    assert len(dead), "the algebra has dead blocks"
    b, d = (int(v) for v in dead[0])
    with torch.no_grad():
        layer.weight[3 * d, 4 * b] = float("nan")
    x = torch.randn(16, layer.in_features, dtype=torch.float64)
    types = torch.arange(16) % 4
    for backend in (Backend.REFERENCE, Backend.BLOCKED):
        layer.backend = backend
        assert not layer(x, types).isnan().any(), backend
