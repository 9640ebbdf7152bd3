"""Which split a set of windows belongs to, and the check that keeps decisions off the
test windows.

Every text an experiment reads has one role:

* **calibration** — the compression's statistics and the fine-tuning stream, from the
  calibration documents' *heads*;
* **validation** — every decision (a fine-tuning curve, its plateau, a continuation, an
  early stop, a learning rate, a checkpoint): the calibration documents' *tails*
  (:func:`holdout_tail`), which no calibration window and no fine-tuning batch reads;
* **test** — the verdicts: windows of the held-out documents, scored once per finished
  arm.

:class:`Windows` carries its role and the documents it was drawn from; a decision function
takes :class:`Windows` and calls :func:`require_validation`, which refuses anything else —
test windows, or a bare tensor of unknown origin — with :class:`TestWindowsError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from structlm.stats import windows_fingerprint

__all__ = ["Role", "TestWindowsError", "Windows", "holdout_tail", "require_validation"]


class Role(StrEnum):
    """The split a set of windows belongs to."""

    CALIBRATION = "calibration"
    VALIDATION = "validation"
    TEST = "test"


class TestWindowsError(ValueError):
    """A decision was about to read windows that are not validation windows."""

    __test__ = False  # not a pytest test class


@dataclass(frozen=True)
class Windows:
    """Token windows ``(n, w)`` of one role, and where they came from."""

    ids: torch.Tensor
    role: Role
    name: str
    """What text this is (e.g. ``validation:austen``)."""
    documents: tuple[str, ...] = ()
    """The documents (or document parts) the windows were drawn from."""

    def __post_init__(self) -> None:
        if self.ids.dim() != 2 or self.ids.shape[0] < 1 or self.ids.shape[1] < 2:
            raise ValueError(f"windows {self.name!r} must be (n >= 1, w >= 2) token ids, got "
                             f"shape {tuple(self.ids.shape)}")
        if not isinstance(self.role, Role):
            raise TypeError(f"role must be a Role, got {self.role!r}")

    @property
    def fingerprint(self) -> str:
        """:func:`structlm.stats.windows_fingerprint` of the ids."""
        return windows_fingerprint(self.ids)

    def spread(self, n_tokens: int) -> Windows:
        """Evenly spaced rows (ordered by document, so they span the documents) that score
        at least ``n_tokens`` tokens; all rows if there are fewer. Same role."""
        n, w = self.ids.shape
        m = min(n, -(-n_tokens // (w - 1)))
        rows = self.ids[torch.linspace(0, n - 1, m).round().long()]
        return Windows(rows, self.role, self.name, self.documents)


def require_validation(windows: object, who: str) -> torch.Tensor:
    """The ids of ``windows`` if they are validation windows; else
    :class:`TestWindowsError` naming ``who`` (the decision) and what it was given."""
    if not isinstance(windows, Windows):
        raise TestWindowsError(f"{who} decides from validation windows only "
                               f"(structlm.hf.splits.Windows with role 'validation'), got "
                               f"{type(windows).__name__}: windows of unknown origin could be "
                               "test windows")
    if windows.role is not Role.VALIDATION:
        raise TestWindowsError(f"{who} decides from validation windows only, got the "
                               f"{windows.role.value} windows {windows.name!r}: decisions "
                               "never read the test text")
    return windows.ids


def holdout_tail(tokens: list[torch.Tensor], fraction: float
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each document's tokens cut into a head and its last ``fraction`` (the validation
    tail), ``(heads, tails)``; a document too short to leave both parts non-empty keeps
    everything in its head."""
    if not 0 < fraction < 1:
        raise ValueError(f"the validation fraction must be in (0, 1), got {fraction}")
    heads, tails = [], []
    for t in tokens:
        cut = t.numel() - round(fraction * t.numel())
        if cut < 1 or cut >= t.numel():
            heads.append(t)
            tails.append(t[:0])
            continue
        heads.append(t[:cut])
        tails.append(t[cut:])
    return heads, tails
