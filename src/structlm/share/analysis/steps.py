"""Resuming an analysis step by step: each finished step's result and the random
generator's state after it are written to ``steps.json`` in the report folder
(atomically), so a run stopped at any instant repeats at most the step it was in, and a
resumed run draws exactly the random numbers an uninterrupted one would.

The steps run in a fixed order; the log is keyed on the content the results depend on
(the configuration, the model's weights, the calibration and evaluation tokens): a
folder holding steps of other content is refused, never overwritten.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from structlm.atomic import atomic_write_json

__all__ = ["StepLog", "StepLogMismatchError"]


class StepLogMismatchError(RuntimeError):
    """The report folder holds the steps of an analysis of other content."""


class StepLog:
    """Finished steps of one analysis (``path``: its ``steps.json``), keyed on
    ``content`` (any JSON-able description of what the results depend on).

    On opening an existing log, ``gen`` is set to its state after the last finished
    step."""

    def __init__(self, path: str | Path, content: dict[str, Any], gen: torch.Generator
                 ) -> None:
        self.path = Path(path)
        self.key = hashlib.sha1(json.dumps(content, sort_keys=True, default=str)
                                .encode()).hexdigest()
        self.gen = gen
        self.steps: dict[str, Any] = {}
        self.seconds: dict[str, float] = {}
        if self.path.exists():
            raw = json.loads(self.path.read_text())
            if raw.get("key") != self.key:
                raise StepLogMismatchError(
                    f"{self.path} holds the finished steps of an analysis of other content "
                    "(configuration, model weights or tokens differ): use another output "
                    "folder, or remove that file to start this one over")
            self.steps = raw["steps"]
            self.seconds = raw.get("seconds", {})
            if raw.get("gen_state"):
                self.restore_gen(raw["gen_state"])

    def done(self, step: str) -> bool:
        """Whether ``step`` finished in this or an earlier run."""
        return step in self.steps

    def get(self, step: str) -> Any:
        """The result recorded for ``step``."""
        return self.steps[step]

    def record(self, step: str, result: Any, seconds: float) -> Any:
        """Record ``step``'s ``result`` (JSON-able) and the ``seconds`` it took, with the
        generator's state now; returns ``result``."""
        self.steps[step] = result
        self.seconds[step] = seconds
        atomic_write_json(self.path, {"key": self.key, "steps": self.steps,
                                      "seconds": self.seconds, "gen_state": self.gen_state()})
        return result

    def gen_state(self) -> str:
        """The generator's state now, as text (to record as a step's result)."""
        return base64.b64encode(bytes(self.gen.get_state().tolist())).decode()

    def restore_gen(self, state: str) -> None:
        """Set the generator to a state from :meth:`gen_state`."""
        self.gen.set_state(torch.tensor(list(base64.b64decode(state)), dtype=torch.uint8))

    def prefixed(self, prefix: str) -> dict[str, Any]:
        """Recorded results of the steps named ``prefix + suffix``, by suffix."""
        return {k[len(prefix):]: v for k, v in self.steps.items() if k.startswith(prefix)}

    def total_seconds(self) -> float:
        """Seconds of every finished step, over all runs."""
        return float(sum(self.seconds.values()))
