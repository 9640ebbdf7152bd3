"""When partial runs redraw their plots (:mod:`structlm.experiments.plot_throttle`)."""

from __future__ import annotations

import pytest

from structlm.experiments.plot_throttle import PlotThrottle


def test_first_and_final_calls_draw_and_the_rest_wait_for_the_interval() -> None:
    t = PlotThrottle(interval_s=3600)
    assert t.due() is True  # the first report of a run has its plots
    assert t.due() is False and t.due() is False  # within the interval: report only
    assert t.due(final=True) is True  # the last report always redraws
    assert t.due() is False


def test_zero_interval_draws_every_time_and_bad_intervals_are_refused() -> None:
    t = PlotThrottle(interval_s=0)
    assert all(t.due() for _ in range(3))
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="interval_s"):
            PlotThrottle(interval_s=bad)
