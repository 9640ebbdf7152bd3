"""Crash-safe checkpoint folders and the one-writer lock of a run folder.

A checkpoint is written into ``checkpoint.tmp-<pid>``, marked complete by a ``COMPLETE``
file (holding its step) written last, then swapped in: ``checkpoint`` → ``checkpoint.old``,
``checkpoint.tmp-<pid>`` → ``checkpoint``, ``checkpoint.old`` removed. A process killed
at any point of that sequence leaves at least one complete checkpoint;
:func:`recover_checkpoint` finds the newest complete one (by step), puts it in place as
``checkpoint`` and removes the rest (incomplete or older temporaries), so a restarted run
resumes from the newest state it had saved.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from structlm.folders import run_folder_lock

__all__ = ["COMPLETE", "recover_checkpoint", "run_folder_lock", "write_checkpoint"]

COMPLETE = "COMPLETE"
"""Marker file written last into a checkpoint folder; its text is the step."""
_FILES = ("model.safetensors", "state.pt")


def write_checkpoint(ckpt: Path, write: Callable[[Path], None], step: int) -> None:
    """Write a checkpoint with ``write(folder)`` and swap it in as ``ckpt`` (see the
    module docstring for the sequence and what a kill at each point leaves)."""
    tmp = ckpt.with_name(f"{ckpt.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    with open(tmp / COMPLETE, "w") as fh:
        fh.write(str(step))
        fh.flush()
        os.fsync(fh.fileno())
    old = ckpt.with_name(ckpt.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if ckpt.exists():
        os.replace(ckpt, old)
    os.replace(tmp, ckpt)
    shutil.rmtree(old, ignore_errors=True)


def _step_of(folder: Path) -> int | None:
    """The step of a complete checkpoint folder, else ``None``. A folder named exactly
    like the checkpoint (or its ``.old``) without a marker was written by an earlier
    version, which renamed only complete folders: its step is read from ``state.pt``."""
    if not folder.is_dir() or not all((folder / f).is_file() for f in _FILES):
        return None
    marker = folder / COMPLETE
    if marker.is_file():
        try:
            return int(marker.read_text())
        except ValueError:
            return None
    if ".tmp-" in folder.name:
        return None  # a temporary without its marker was cut short
    import torch

    try:
        return int(torch.load(folder / "state.pt", weights_only=False, map_location="cpu",
                              mmap=True)["step"])
    except Exception:  # a truncated file: not a usable checkpoint
        return None


def recover_checkpoint(ckpt: Path) -> tuple[Path | None, list[str]]:
    """Put the newest complete checkpoint in place as ``ckpt`` and delete the other
    candidates (``ckpt``, ``ckpt.old``, ``ckpt.tmp-*``). Returns ``(ckpt or None, what was
    done)`` — ``None`` when no complete checkpoint exists."""
    candidates = [ckpt, ckpt.with_name(ckpt.name + ".old"),
                  *sorted(ckpt.parent.glob(f"{ckpt.name}.tmp-*"))]
    steps = {p: _step_of(p) for p in candidates if p.exists()}
    complete = {p: s for p, s in steps.items() if s is not None}
    notes: list[str] = []
    best = max(complete, key=lambda p: (complete[p], p == ckpt)) if complete else None
    for path in steps:
        if path not in (best, ckpt):
            shutil.rmtree(path, ignore_errors=True)
            what = "incomplete" if steps[path] is None else f"step {steps[path]}"
            notes.append(f"removed {path.name} ({what})")
    if best is not None and best != ckpt:
        shutil.rmtree(ckpt, ignore_errors=True)
        os.replace(best, ckpt)
        notes.append(f"resumed from {best.name} (step {complete[best]}), the newest complete "
                     "checkpoint")
    elif best is None and ckpt.exists():
        shutil.rmtree(ckpt, ignore_errors=True)
        notes.append(f"removed {ckpt.name} (incomplete)")
    return (ckpt if best is not None else None), notes
