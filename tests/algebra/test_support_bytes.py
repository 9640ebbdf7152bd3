"""``LayerSupport.weight_elements``: the weight a call with given types must read."""

from __future__ import annotations

from fractions import Fraction

import pytest

from structlm.algebra.catalogue import get_algebra
from structlm.algebra.structure import AlgebraError
from structlm.algebra.support import support_of


@pytest.mark.parametrize("name", ["Q2", "Q4", "Q2^2", "Q8"])
def test_one_type_reads_its_row_macs_and_all_types_the_used_blocks(name: str) -> None:
    support = support_of(get_algebra(name))
    q = support.q
    s = [3 + i for i in range(q)]  # unequal widths
    r = [5 + 2 * i for i in range(q)]
    row = support.row_macs(s, r)
    for a in range(q):
        assert support.weight_elements([a], s, r) == row[a]
    every = support.weight_elements(range(q), s, r)
    assert every == sum(s[b] * r[d] for b in range(q) for d in range(q)
                        if support.used_blocks[b, d])
    assert support.weight_elements([0, 0, 1], s, r) == support.weight_elements([1, 0], s, r)
    assert support.weight_elements([], s, r) == 0
    assert max(row) <= support.weight_elements([0, q - 1], s, r) <= every


def test_equal_widths_one_type_is_rho_of_the_weight() -> None:
    support = support_of(get_algebra("Q2^2"))
    assert Fraction(support.weight_elements([2], [4] * 4, [4] * 4), 16 * 16) == Fraction(9, 16)


def test_types_out_of_range_are_refused() -> None:
    support = support_of(get_algebra("Q4"))
    with pytest.raises(AlgebraError, match=r"types \[4\]"):
        support.weight_elements([0, 4], [1] * 4, [1] * 4)
