"""The bad-input sweep (benchmarks/bad_input_sweep.py: ~300 cases over every command, its
fixtures built offline) stays at zero unclear messages, tracebacks, silent cases and lost
work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_bad_input_in_the_sweep_is_a_clear_error(tmp_path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "sweep.md"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bad_input_sweep.py"),
                          "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = out.read_text()
    assert "0 unclear, 0 tracebacks, 0 silent, 0 lost work" in text
    assert int(text.split("\n\n")[2].split()[0]) >= 200  # cases
