"""Crash-safe checkpoint folders that a resume never deletes to recover.

A checkpoint is written into ``checkpoint.tmp-<pid>``, marked complete by a ``COMPLETE``
file written last (JSON: the step and every file's size), then swapped in:
``checkpoint`` → ``checkpoint.old``, ``checkpoint.tmp-<pid>`` → ``checkpoint``,
``checkpoint.old`` removed — so the previous complete checkpoint is kept until the next
one is complete. A process killed at any point of that sequence leaves at least one
complete checkpoint, and :func:`recover_checkpoint` puts the newest in place.

What a resume never does is delete the only copy of a run: a ``checkpoint`` that is
damaged (its marker empty or garbage, a file missing, or a file shorter or longer than
the marker recorded) is refused with a :class:`~structlm.config.RunError` naming the
damaged file and how to recover — resume from the previous complete checkpoint if one is
kept, or start over with ``--restart``, which moves everything aside
(:func:`discard_run`) instead of deleting it. Only temporaries cut short before their
marker, which never held a complete state, are removed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from structlm.config import RunError
from structlm.folders import run_folder_lock

__all__ = ["COMPLETE", "CheckpointState", "discard_run", "inspect_checkpoint",
           "recover_checkpoint", "run_folder_lock", "write_checkpoint"]

COMPLETE = "COMPLETE"
"""Marker file written last into a checkpoint folder: JSON with the step and the size of
every file (a bare step number in checkpoints of earlier versions)."""
_FILES = ("model.safetensors", "state.pt")


def write_checkpoint(ckpt: Path, write: Callable[[Path], None], step: int) -> None:
    """Write a checkpoint with ``write(folder)`` and swap it in as ``ckpt`` (see the
    module docstring for the sequence and what a kill at each point leaves)."""
    tmp = ckpt.with_name(f"{ckpt.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own cut-short temporary
    tmp.mkdir(parents=True)
    write(tmp)
    sizes = {f: (tmp / f).stat().st_size for f in _FILES}
    with open(tmp / COMPLETE, "w") as fh:
        fh.write(json.dumps({"step": step, "files": sizes}))
        fh.flush()
        os.fsync(fh.fileno())
    old = ckpt.with_name(ckpt.name + ".old")
    shutil.rmtree(old, ignore_errors=True)  # ckpt is complete: .old is the older copy
    if ckpt.exists():
        os.replace(ckpt, old)
    os.replace(tmp, ckpt)
    shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True)
class CheckpointState:
    """What a checkpoint folder holds: its step when complete, else what is wrong."""

    path: Path
    step: int | None
    problem: str = ""

    @property
    def complete(self) -> bool:
        return self.step is not None


def inspect_checkpoint(folder: Path) -> CheckpointState:
    """The step of a complete checkpoint folder, or the damage that makes it unusable."""
    if not folder.is_dir():
        return CheckpointState(folder, None, f"{folder} is not a folder")
    missing = [f for f in _FILES if not (folder / f).is_file()]
    if missing:
        return CheckpointState(folder, None, f"{folder / missing[0]} is missing")
    marker = folder / COMPLETE
    if not marker.is_file():
        if ".tmp-" in folder.name:
            return CheckpointState(folder, None, f"{folder} was cut short before {COMPLETE}")
        return _legacy(folder)  # renamed complete by a version that wrote no marker
    text = marker.read_text().strip()
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if isinstance(record, int) and not isinstance(record, bool):
        return CheckpointState(folder, record)  # a bare step: no sizes to check
    if not (isinstance(record, dict) and isinstance(record.get("step"), int)
            and isinstance(record.get("files"), dict)):
        return CheckpointState(folder, None, f"{marker} holds {text[:40]!r}, not the step "
                                             "and file sizes it is written with")
    for name, size in record["files"].items():
        actual = (folder / name).stat().st_size if (folder / name).is_file() else None
        if actual != size:
            return CheckpointState(folder, None, f"{folder / name} is {actual} bytes, "
                                                 f"{COMPLETE} recorded {size} (truncated or "
                                                 "overwritten)")
    return CheckpointState(folder, int(record["step"]))


def _legacy(folder: Path) -> CheckpointState:
    import torch

    try:
        step = int(torch.load(folder / "state.pt", weights_only=False, map_location="cpu",
                              mmap=True)["step"])
    except Exception as e:
        return CheckpointState(folder, None, f"{folder / 'state.pt'} cannot be read "
                                             f"({type(e).__name__})")
    return CheckpointState(folder, step)


def recover_checkpoint(ckpt: Path) -> tuple[Path | None, list[str]]:
    """Put the newest complete checkpoint in place as ``ckpt``; returns ``(ckpt or None,
    what was done)`` — ``None`` when the run has no checkpoint yet.

    Removes only temporaries cut short before their marker (never complete) and complete
    copies older than the one put in place.

    Raises:
        RunError: ``ckpt`` exists but is damaged: the message names the damaged file, the
            previous complete checkpoint if one is kept, and ``--restart``.
    """
    old = ckpt.with_name(ckpt.name + ".old")
    temps = sorted(ckpt.parent.glob(f"{ckpt.name}.tmp-*"))
    states = {p: inspect_checkpoint(p) for p in [ckpt, old, *temps] if p.exists()}
    notes: list[str] = []
    current = states.get(ckpt)
    kept = {p: s for p, s in states.items() if s.complete and p != ckpt}
    if current is not None and not current.complete:
        previous = max(kept.values(), key=lambda s: s.step or 0, default=None)
        hint = (f"the previous complete checkpoint {previous.path.name} (step "
                f"{previous.step}) is kept: to resume from it, move {ckpt.name} aside "
                f"(e.g. mv {ckpt} {ckpt}.damaged) and run again; "
                if previous is not None else "")
        raise RunError(f"the checkpoint is damaged: {current.problem}. Nothing was deleted; "
                       f"{hint}to start over from step 0, run again with --restart (the "
                       "run's checkpoints and metrics are moved aside, not deleted)")
    for path, state in states.items():
        if ".tmp-" in path.name and not state.complete:
            shutil.rmtree(path, ignore_errors=True)
            notes.append(f"removed {path.name} ({state.problem})")
    complete = {p: s for p, s in states.items() if s.complete}
    if not complete:
        return None, notes
    best = max(complete, key=lambda p: (complete[p].step, p == ckpt))
    older = [p for p in complete if p not in (best, ckpt)]
    if best != ckpt:
        if ckpt.exists():  # complete but older: the copy the interrupted swap replaced
            older.append(ckpt.with_name(f"{ckpt.name}.replaced"))
            os.replace(ckpt, older[-1])
        os.replace(best, ckpt)
        notes.append(f"resumed from {best.name} (step {complete[best].step}), the newest "
                     "complete checkpoint")
    for path in older:  # complete copies older than the one in place
        shutil.rmtree(path, ignore_errors=True)
        notes.append(f"removed {path.name} (older than the checkpoint in place)")
    return ckpt, notes


def discard_run(out: Path, names: tuple[str, ...] = ("checkpoint", "metrics.csv")) -> Path | None:
    """Move a run's checkpoints (``checkpoint``, ``.old``, temporaries) and ``names`` into
    ``out/discarded-<UTC time>/`` (``--restart``): nothing is deleted. Returns the folder,
    or ``None`` when there was nothing to move."""
    found = [p for n in names for p in sorted(out.glob(n + "*"))]
    if not found:
        return None
    dest = out / time.strftime("discarded-%Y%m%dT%H%M%SZ", time.gmtime())
    dest.mkdir(parents=True, exist_ok=False)
    for p in found:
        os.replace(p, dest / p.name)
    return dest
