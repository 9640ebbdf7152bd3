"""When a long run's plots are redrawn.

The experiments rewrite their report after every finished arm, so that a partial run
folder always has a current ``report.md``. Drawing the plots (matplotlib) costs seconds
each time, which matters when arms are fast (the reduced test runs) and not at all when
they take minutes; so the plots are drawn the first time, the last time, and otherwise
at most once per interval.
"""

from __future__ import annotations

import math
import time

PLOT_INTERVAL_S = 60.0


class PlotThrottle:
    """``due(final)`` is True on the first call, on a final call, and when at least
    ``interval_s`` seconds have passed since the last call that returned True."""

    def __init__(self, interval_s: float = PLOT_INTERVAL_S) -> None:
        if not interval_s >= 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s!r}")
        self.interval_s = interval_s
        self._last = -math.inf

    def due(self, final: bool = False) -> bool:
        now = time.monotonic()
        if final or now - self._last >= self.interval_s:
            self._last = now
            return True
        return False
