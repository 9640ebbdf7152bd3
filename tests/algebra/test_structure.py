"""Algebra facts computed from structure tensors, against the closed forms."""

from fractions import Fraction

import numpy as np
import pytest

from structlm.algebra import (
    Algebra,
    AlgebraError,
    complete_graph_algebra,
    get_algebra,
    graph_algebra,
    support_of,
    tensor_power,
)


@pytest.mark.parametrize("q", [1, 2, 3, 4, 5, 8, 16])
def test_complete_graph_facts(q: int) -> None:
    a = complete_graph_algebra(q)
    assert a.dim == q * q
    assert a.is_associative and a.has_unit
    assert a.num_maximal_ideals == q
    assert a.radical_dim == q * (q - 1)
    assert a.rank.lower_bound == 2 * q * q - q == a.rank.explicit_products == a.rank.exact
    unit = np.zeros(a.dim)
    unit[:q] = 1.0  # sum of the vertex idempotents
    np.testing.assert_array_equal(a.unit, unit)
    assert support_of(a).num_triples == 2 * q * q - q


def test_spec_table_numbers() -> None:
    """SPEC §A.2: slots, block products, equal-width MAC ratio, exact rank."""
    rows = {name: get_algebra(name) for name in ("Q2", "Q4", "Q2^2")}
    got = {
        n: (a.dim, support_of(a).num_triples, support_of(a).mac_ratio(), a.rank.exact,
            a.rank.interval)
        for n, a in rows.items()
    }
    assert got["Q2"] == (4, 6, Fraction(3, 4), 6, (6, 6))
    assert got["Q4"] == (16, 28, Fraction(7, 16), 28, (28, 28))
    assert got["Q2^2"] == (16, 36, Fraction(9, 16), None, (28, 36))
    for a in rows.values():
        assert a.rank.explicit_products == support_of(a).num_triples


@pytest.mark.parametrize("power", [1, 2, 3])
def test_tensor_powers_of_q2(power: int) -> None:
    a = get_algebra(f"Q2^{power}")
    s = support_of(a)
    assert a.dim == 4**power and a.is_associative and a.has_unit
    assert a.rank.explicit_products == 6**power == s.num_triples
    assert s.mac_ratio() == Fraction(3, 4) ** power
    assert a.num_maximal_ideals == 2**power
    # bitwise rule: beta_k in {alpha_k, delta_k}
    q = 2**power
    for al in range(q):
        for be in range(q):
            for de in range(q):
                rule = all(((be >> k) & 1) in {(al >> k) & 1, (de >> k) & 1} for k in range(power))
                assert s.mask[al, be, de] == rule


def test_q_support_rule_and_rho() -> None:
    for q in (2, 3, 4, 7, 8):
        s = support_of(complete_graph_algebra(q))
        for al in range(q):
            for be in range(q):
                for de in range(q):
                    assert s.mask[al, be, de] == (be == de or be == al)
        assert s.mac_ratio() == Fraction(2 * q - 1, q * q)


def test_random_graphs() -> None:
    rng = np.random.default_rng(1)
    for _ in range(12):
        n = int(rng.integers(1, 6))
        edges = [(a, b) for a in range(n) for b in range(n) if a != b and rng.random() < 0.5]
        g = graph_algebra(n, edges)
        assert g.dim == n + len(edges)
        assert g.is_associative and g.has_unit
        assert g.num_maximal_ideals == n
        assert g.radical_dim == len(edges)
        assert g.rank.exact == n + 2 * len(edges)
        s = support_of(g)
        for al in range(n):
            for be in range(n):
                for de in range(n):
                    want = be == de or (be == al and (al, de) in edges)
                    assert s.mask[al, be, de] == want
        assert s.num_triples == n * n + len(edges)


def test_graph_name_roundtrip_and_dead_blocks() -> None:
    g = get_algebra("graph:3:0-1,1-2,2-0")
    assert g.dim == 6 and g.rank.exact == 9
    s = support_of(g)
    used = s.used_blocks
    assert used[0, 1] and used[1, 2] and used[2, 0]
    assert not used[1, 0] and not used[2, 1] and not used[0, 2]  # absent edges: dead


def test_tensor_product_name() -> None:
    a = get_algebra("Q2xQ3")
    assert a.dim == 36 and a.q == 6 and a.is_associative and a.has_unit
    assert a.rank.explicit_products == 6 * 15
    assert a.num_maximal_ideals == 6


def test_non_associative_rejected() -> None:
    q2 = complete_graph_algebra(2)
    # add a term a01 * a10 = e0 : breaks associativity ((a01 a10) a01 = a01, a01 (a10 a01) = 0)
    entries = np.vstack([q2.entries, [[2, 3, 0]]])
    values = np.concatenate([q2.values, [1.0]])
    bad = Algebra("bad", q2.dim, entries, values, q2.basis_names, q2.cells, 2)
    assert not bad.is_associative
    assert bad.associativity_defect > 0.5
    with pytest.raises(AlgebraError, match="not associative"):
        support_of(bad)


def test_unitless_rejected() -> None:
    # the 2-dim algebra with b0 b0 = b1 and all else 0: associative, nilpotent, no unit
    nil = Algebra("nil", 2, [[0, 0, 1]], [1.0], cells=[[0, 0], [0, 1]], q=2)
    assert nil.is_associative and not nil.has_unit
    assert nil.num_maximal_ideals == 0
    with pytest.raises(AlgebraError, match="no two-sided unit"):
        support_of(nil)


def test_matrix_algebra_facts() -> None:
    # full 2x2 matrix algebra M_2: semisimple, non-commutative -> t unknown here
    e = []
    for a in range(2):
        for b in range(2):
            for d in range(2):
                e.append((a * 2 + b, b * 2 + d, a * 2 + d))
    m2 = Algebra("M2", 4, e, np.ones(len(e)), cells=[[0, 0], [0, 1], [1, 0], [1, 1]], q=2)
    assert m2.is_associative and m2.has_unit and m2.radical_dim == 0
    assert m2.num_maximal_ideals is None and m2.rank.exact is None
    assert m2.rank.explicit_products == 8


def test_multiply_matches_coordinates() -> None:
    a = complete_graph_algebra(3)
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(a.dim), rng.standard_normal(a.dim)
    z = a.multiply(x, w)
    cell = {tuple(c): i for i, c in enumerate(a.cells)}
    for i in range(3):
        for j in range(3):
            k = cell[(i, j)]
            if i == j:
                want = x[k] * w[k]
            else:
                want = x[cell[(i, i)]] * w[k] + x[k] * w[cell[(j, j)]]
            assert z[k] == pytest.approx(want)


@pytest.mark.parametrize("bad", ["Q0", "Q", "Q4^0", "foo", "graph:3:0-0", "graph:2:0-5",
                                 "graph:3:0+1", "graph:2:0-1,0-1"])
def test_bad_names(bad: str) -> None:
    with pytest.raises(AlgebraError) as err:
        get_algebra(bad)
    assert str(err.value)


def test_self_loop_message() -> None:
    with pytest.raises(AlgebraError, match="self-loop 1-1"):
        graph_algebra(2, [(1, 1)])


def test_tensor_power_validation() -> None:
    with pytest.raises(AlgebraError, match="tensor power"):
        tensor_power(complete_graph_algebra(2), 0)


def test_huge_graph_algebras_are_refused_before_allocating() -> None:
    from structlm.algebra import get_algebra

    with pytest.raises(AlgebraError, match="100,000 vertices is over the 256"):
        get_algebra("graph:100000:0-1")


def test_algebra_linear_refuses_a_non_float_dtype() -> None:
    import torch

    from structlm import AlgebraLinear

    with pytest.raises(AlgebraError, match=r"floating-point torch dtype .*int32"):
        AlgebraLinear(8, 8, "Q2", dtype=torch.int32)
