"""Loss curves from metrics CSVs (several runs on one chart)."""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence

__all__ = ["plot_loss_curves"]


def plot_loss_curves(runs: Sequence[tuple[str, str]], png_path: str) -> None:
    """``runs``: (label, metrics.csv) pairs; train loss (thin) and validation loss
    (markers) against tokens seen, written atomically to ``png_path``."""
    from structlm.plotting import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, path) in enumerate(runs):
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
        color = f"C{i}"
        ax.plot([int(r["tokens"]) for r in rows], [float(r["train_loss"]) for r in rows],
                color=color, lw=0.8, alpha=0.6, label=f"{label} train")
        val = [r for r in rows if r["val_loss"]]
        ax.plot([int(r["tokens"]) for r in val], [float(r["val_loss"]) for r in val],
                "o-", color=color, label=f"{label} validation")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, png_path)
