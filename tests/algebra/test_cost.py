"""Cost formulas of SPEC §A.2–A.5, reproduced exactly."""

from fractions import Fraction

import pytest

from structlm.algebra import cost
from structlm.algebra.structure import AlgebraError


def test_paper_lm_projection_ratio() -> None:
    d = 768
    r = cost.decode_projection_ratio(d, d, d, 2 * d, Fraction(9, 16))
    assert r == Fraction(59, 80)
    assert cost.algebra_rho("Q2^2") == Fraction(9, 16)


def test_attention_bounds() -> None:
    f4, t4 = cost.attention_speedup_bounds(cost.rho_q(4))
    assert f4 == Fraction(32, 23) and round(float(f4), 3) == 1.391
    assert round(float(t4), 3) == 1.474
    f22, t22 = cost.attention_speedup_bounds(Fraction(9, 16))
    assert round(float(f22), 3) == 1.280 and round(float(t22), 3) == 1.333


def test_attention_score_ratio_limit() -> None:
    # a balanced causal sequence of length L, cyclic types: rho_score -> rho_q
    q, length = 4, 4096
    pairs = length * (length + 1) // 2
    same = sum((p // q) + 1 for p in range(length))  # keys u <= p with u = p mod q
    r = cost.attention_score_ratio(pairs, same, q)
    assert abs(float(r) - float(cost.rho_q(q))) < 1e-3
    with pytest.raises(AlgebraError):
        cost.attention_score_ratio(0, 0, 4)


def test_projection_macs_general_widths() -> None:
    widths_in, widths_out = [3, 5], [2, 7]
    counts = [4, 9]
    # C = M D_diag + sum_i M_i s_i (N - r_i)
    d_diag = 3 * 2 + 5 * 7
    want = 13 * d_diag + 4 * 3 * (9 - 2) + 9 * 5 * (9 - 7)
    assert cost.projection_forward_macs("Q2", counts, widths_in, widths_out) == want
    assert cost.projection_training_macs("Q2", counts, widths_in, widths_out) == 3 * want


def test_swiglu_and_decode() -> None:
    assert cost.swiglu_macs(10, 768, 1536, Fraction(9, 16)) == Fraction(9, 16) * 9 * 10 * 768 * 1536
    assert cost.swiglu_macs(10, 8, 16, 1, training=False) == 3 * 10 * 8 * 16
    assert cost.decode_macs(4, 4, 2, 8, 100) == 2 * 16 + 2 * 8 + 3 * 32 + 2 * 100 * 4


def test_square_costs() -> None:
    for q in (2, 4, 32):
        n = 64 * q
        assert cost.square_cost(n, q) == (Fraction(2, q) - Fraction(1, q * q)) * n**3
    n, b = 4096, 128
    assert cost.fixed_leaf_square_cost(n, b) == 2 * b * n * n - b * b * n
    assert cost.block_rank_lower_bound(4, 8) == 2 * 32 * 32 - 4
    assert cost.screening_max_q(2048, 4096, 4096, 64, 128, 128) == 32
