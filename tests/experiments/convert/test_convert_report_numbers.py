"""The report's derived numbers: the share of the damage that healing recovered."""

from __future__ import annotations

import math

import pytest

from structlm.experiments.convert.report import _recovered


def test_recovered_share_of_the_log_damage() -> None:
    # 35.73 -> 9,992 after the change -> 142.9 healed: the log-damage undone
    want = (math.log(9992.0) - math.log(142.9)) / (math.log(9992.0) - math.log(35.73))
    assert _recovered(35.73, 9992.0, 142.9) == pytest.approx(want)
    assert _recovered(35.73, 9992.0, 9992.0) == 0.0
    assert _recovered(35.73, 9992.0, 20.0) > 1  # healed below the original: more than all
    assert _recovered(35.73, 30.0, 25.0) is None  # the change improved it: no damage


def test_an_unchanged_model_evaluated_twice_has_no_recovered_share() -> None:
    """The dense control's perplexity after the change equals the original up to the
    last bits; a share of that rounding difference is no number."""
    assert _recovered(40.78, 40.78 * (1 + 1e-12), 54.47) is None
    assert _recovered(40.78, 40.78 * (1 + 1e-3), 40.78) == pytest.approx(1.0, rel=1e-6)
