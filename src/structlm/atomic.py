"""Atomic file writes: a temporary file in the same folder, then ``os.replace``."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_json", "atomic_write_text"]


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``."""
    fd, tmp = tempfile.mkstemp(dir=Path(path).parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    """:func:`atomic_write_text` of ``obj`` as indented JSON."""
    atomic_write_text(path, json.dumps(obj, indent=1))
