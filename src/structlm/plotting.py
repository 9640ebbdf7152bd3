"""Plots are an extra: ``pip install "structlm[plots]"`` (matplotlib). Only reports and
benchmarks draw them, and only through :func:`pyplot`, which imports matplotlib on first
use (headless ``Agg``) — ``import structlm`` never does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["pyplot", "save_figure"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the headless Agg backend.

    Raises:
        ImportError: matplotlib is not installed (the message says how to get it).
    """
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError('plots need matplotlib: pip install "structlm[plots]" (or pip '
                          "install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path | str, dpi: int = 110) -> None:
    """Save a matplotlib figure to ``path`` through a temporary PNG and ``os.replace``,
    then close it."""
    path = Path(path)
    tmp = path.with_name(".tmp-" + path.name)
    fig.savefig(tmp, dpi=dpi, format="png")
    pyplot().close(fig)
    os.replace(tmp, path)
