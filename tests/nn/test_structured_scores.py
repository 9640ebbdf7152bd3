"""Structured attention scores: the sorted-block implementation against the definition."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from structlm.algebra import get_algebra, support_of
from structlm.algebra.cost import attention_score_ratio
from structlm.nn.structured_scores import (
    score_groups,
    structured_attention,
    structured_rho,
    structured_score_macs,
    structured_scores_reference,
)


def _groups(name: str) -> torch.Tensor:
    return score_groups(support_of(get_algebra(name)).mask)


def _seed_scores(q: torch.Tensor, k: torch.Tensor, qt: torch.Tensor, kt: torch.Tensor,
                 nq: int) -> torch.Tensor:
    """Seed 000 appendix G written out for ``Q_q``: groups ``{i, j}``, scale
    ``1 / sqrt(|F| m)``; a loop over every pair, in float64."""
    b, h, t, hs = q.shape
    m = hs // nq
    out = torch.empty(b, h, t, k.shape[2], dtype=torch.float64)
    for r in range(b):
        for p in range(t):
            for u in range(k.shape[2]):
                f = sorted({int(qt[r, p]), int(kt[r, u])})
                cols = torch.cat([torch.arange(a * m, (a + 1) * m) for a in f])
                dot = (q[r, :, p, cols].double() * k[r, :, u, cols].double()).sum(-1)
                out[r, :, p, u] = dot / (len(f) * m) ** 0.5
    return out


def test_groups_of_q4_are_the_seeds_pairs_and_q2x2_is_bitwise() -> None:
    g4 = _groups("Q4")
    for i in range(4):
        for j in range(4):
            assert set(g4[i, j].nonzero().flatten().tolist()) == {i, j}
    g22 = _groups("Q2^2")
    for i in range(4):
        for j in range(4):
            want = {a for a in range(4) if all(((a >> b) & 1) in {(i >> b) & 1, (j >> b) & 1}
                                               for b in range(2))}
            assert set(g22[i, j].nonzero().flatten().tolist()) == want
            assert len(want) == 2 ** bin(i ^ j).count("1")


@pytest.mark.parametrize("name", ["Q2", "Q4"])
def test_reference_is_the_seeds_definition(name: str) -> None:
    nq = get_algebra(name).q
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 3, 7, 4 * nq, generator=gen), torch.randn(2, 3, 5, 4 * nq, generator=gen)
    qt = torch.randint(0, nq, (2, 7), generator=gen)
    kt = torch.randint(0, nq, (2, 5), generator=gen)
    got = structured_scores_reference(q.double(), k.double(), qt, kt, _groups(name))
    torch.testing.assert_close(got, _seed_scores(q, k, qt, kt, nq))


def _reference_attention(q, k, v, qt, kt, groups, mask):
    s = structured_scores_reference(q.double(), k.double(), qt, kt, groups)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v.double()


@pytest.mark.parametrize("name", ["Q2", "Q4", "Q2^2", "Q8"])
@pytest.mark.parametrize(("t", "s"), [(1, 1), (1, 97), (7, 7), (97, 97), (7, 1025)])
def test_fast_equals_reference(name: str, t: int, s: int) -> None:
    nq = get_algebra(name).q
    groups = _groups(name)
    gen = torch.Generator().manual_seed(t * 1000 + s)
    hs = 2 * nq if nq > 4 else 3 * nq
    q, k, v = (torch.randn(2, 3, n, hs, generator=gen) for n in (t, s, s))
    qt = torch.randint(0, nq, (t,), generator=gen).expand(2, t)
    kt = torch.randint(0, nq, (s,), generator=gen).expand(2, s)
    mask = torch.rand(2, 1, t, s, generator=gen) < 0.7
    mask[..., 0] = True  # every query sees a key
    got = structured_attention(q, k, v, qt, kt, groups, mask)
    torch.testing.assert_close(got.double(), _reference_attention(q, k, v, qt, kt, groups, mask),
                               rtol=1e-5, atol=1e-5)


def test_rows_with_their_own_types_and_leading_batch() -> None:
    groups = _groups("Q2^2")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(5, 2, n, 8, generator=gen) for n in (7, 11, 11))
    qt, kt = torch.randint(0, 4, (5, 7), generator=gen), torch.randint(0, 4, (5, 11), generator=gen)
    got = structured_attention(q, k, v, qt, kt, groups)
    torch.testing.assert_close(got.double(), _reference_attention(q, k, v, qt, kt, groups, None),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-12),
                                            (torch.bfloat16, 3e-2)])
def test_dtypes(dtype: torch.dtype, tol: float) -> None:
    groups = _groups("Q4")
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 33, 16, generator=gen) for _ in range(3))
    types = (torch.arange(33) // 5 % 4).expand(1, 33)
    got = structured_attention(q.to(dtype), k.to(dtype), v.to(dtype), types, types, groups)
    assert got.dtype == dtype
    want = _reference_attention(q.to(dtype), k.to(dtype), v.to(dtype), types, types, groups,
                                None)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_gradients_match_the_reference() -> None:
    groups = _groups("Q2^2")
    gen = torch.Generator().manual_seed(5)
    leaves = [torch.randn(2, 2, n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
              for n in (9, 9, 9)]
    types = (torch.arange(9) % 4).expand(2, 9)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    w = torch.randn(2, 2, 9, 8, generator=gen, dtype=torch.float64)
    (structured_attention(*leaves, types, types, groups, mask) * w).sum().backward()
    fast = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    (_reference_attention(*leaves, types, types, groups, mask) * w).sum().backward()
    for a, x in zip(fast, leaves, strict=True):
        torch.testing.assert_close(a, x.grad)


def test_nan_stays_in_its_query_row() -> None:
    groups = _groups("Q4")
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 1, 8, 8, generator=gen) for _ in range(3))
    q[0, 0, 3, 0] = float("nan")
    types = (torch.arange(8) % 4).expand(1, 8)
    out = structured_attention(q, k, v, types, types, groups)
    assert out[0, 0, 3].isnan().all()
    assert not out[0, 0, [0, 1, 2, 4, 5, 6, 7]].isnan().any()


def test_executed_macs_are_rho_score_of_dense() -> None:
    """FLOP-counted: score products cost structured_score_macs, PV stays dense."""
    groups = _groups("Q2^2")
    t, hs, h = 64, 16, 2
    types = (torch.arange(t) // 8 % 4).expand(1, t)
    q, k, v = (torch.randn(1, h, t, hs) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        structured_attention(q, k, v, types, types, groups)
    score = structured_score_macs(types, types, groups, hs, h)
    assert counter.get_total_flops() == 2 * (score + h * t * t * hs)
    assert Fraction(score, h * t * t * hs) == Fraction(9, 16)  # balanced: (3/4)^2


def test_rho_score_is_the_seeds_formula_for_q4() -> None:
    groups = _groups("Q4")
    t = 50
    types = (torch.arange(t) // 4 % 4).expand(1, t)
    allowed = torch.ones(t, t, dtype=torch.bool).tril()[None]
    pairs = int(allowed.sum())
    same = int((allowed & (types[0][:, None] == types[0][None, :])).sum())
    assert structured_rho(types, types, groups, allowed) == attention_score_ratio(pairs, same, 4)
    long = (torch.arange(4096) % 4).expand(1, 4096)
    assert abs(float(structured_rho(long, long, groups)) - 7 / 16) < 1e-9


def test_errors_name_the_problem() -> None:
    groups = _groups("Q4")
    x = torch.randn(1, 1, 3, 6)
    with pytest.raises(ValueError, match="head size 6 is not divisible by q=4"):
        structured_attention(x, x, x, torch.zeros(1, 3, dtype=torch.long),
                             torch.zeros(1, 3, dtype=torch.long), groups)
    y = torch.randn(1, 1, 3, 8)
    with pytest.raises(ValueError, match=r"types \(1, 2\)"):
        structured_attention(y, y, y, torch.zeros(1, 2, dtype=torch.long),
                             torch.zeros(1, 3, dtype=torch.long), groups)
