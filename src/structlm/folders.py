"""Output folders: one writer at a time, and never over an input.

* :func:`run_folder_lock` holds ``folder/.lock`` (``flock``) for a block: a second writer
  of the same folder fails at once with a clear error instead of interleaving files.
* :func:`check_apart` refuses an output folder that is, contains or lies inside any of a
  command's input folders (a model it reads, that model's source): writing there could
  overwrite or delete the only copy of an input.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from structlm.config import RunError

__all__ = ["check_apart", "run_folder_lock"]


_HELD: dict[Path, IO[str]] = {}
"""The run folders this process holds the lock of (resolved path -> the lock file)."""


@contextmanager
def run_folder_lock(folder: Path, what: str = "run") -> Iterator[IO[str]]:
    """Hold ``folder/.lock`` (``flock``) for the block (``folder`` is created; a folder
    this call created that holds nothing but the lock when the block ends — a run refused
    before writing anything — is removed again). Re-entrant within a process: a block
    inside another that holds the same folder goes on under the outer lock."""
    folder = Path(folder)
    key = folder.resolve()
    if key in _HELD:  # this process is the writer already (an API called by a command)
        yield _HELD[key]
        return
    if folder.exists() and not folder.is_dir():
        raise RunError(f"{folder} is a file, not a folder: choose another {what} folder")
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    fh = open(folder / ".lock", "w")  # held for the whole block
    locked = False
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunError(f"{folder} is being written by another process (one writer "
                           f"per {what} folder)") from None
        locked = True
        _HELD[key] = fh
        yield fh
    finally:
        _HELD.pop(key, None)
        if locked and created and [p.name for p in folder.iterdir()] == [".lock"]:
            (folder / ".lock").unlink(missing_ok=True)  # still held: no one else is in
            folder.rmdir()
        fh.close()


def check_apart(out: Path | str, inputs: Iterable[Path | str], what: str = "output") -> None:
    """Refuse ``out`` when it is, contains or lies inside an existing input folder.

    Raises:
        ValueError: naming both folders.
    """
    o = Path(out).resolve()
    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"{what} {str(out)!r} is a file, not a folder: choose a folder")
    for item in inputs:
        path = Path(item)
        if not path.exists():
            continue
        i = path.resolve()
        if i == o or i in o.parents or o in i.parents:
            raise ValueError(f"{what} {str(out)!r} overlaps the input {str(item)!r}: an "
                             "output must never hold, overwrite or delete an input; choose "
                             "a folder outside it")
