"""Finished runs kept by one experiment folder (``arms.json``: a map from a run's key to
its record), and adding those of other folders of the same experiment: parts of one plan
run by other processes or machines, or a committed snapshot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from structlm.config import ConfigError

__all__ = ["merge_finished_runs", "read_finished_runs"]


def read_finished_runs(folder: str | Path, what: str) -> dict[str, Any]:
    """The finished runs in ``folder/arms.json``; a clear error if there are none to read
    (``what`` names the command whose folder was expected)."""
    path = Path(folder) / "arms.json"
    if not path.is_file():
        raise ConfigError(f"add_runs: {folder} has no arms.json (expected a folder of "
                          f"`{what}`)")
    runs = json.loads(path.read_text())
    if not isinstance(runs, dict):
        raise ConfigError(f"add_runs: {path} is not a map of finished runs")
    return runs


def merge_finished_runs(done: dict[str, Any], others: list[dict[str, Any]]) -> int:
    """Add to ``done`` the runs of ``others`` it lacks; returns how many were added. A run
    finished in two folders must have the same record (refused otherwise)."""
    added = 0
    for runs in others:
        for key, record in runs.items():
            if key not in done:
                done[key], added = record, added + 1
            elif done[key] != record:
                raise ConfigError(f"add_runs: the run {key} was finished twice with different "
                                  "results; keep one of the folders")
    return added
