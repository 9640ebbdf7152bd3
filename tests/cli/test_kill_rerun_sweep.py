"""The kill-and-rerun sweep (benchmarks/kill_rerun_sweep.py: every writing command killed
with SIGKILL at seeded random points, then rerun into the same folder) finds every rerun
finishing, equal to an uninterrupted run, the input intact and nothing left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLEAN = "0 reruns failed, 0 unequal, 0 input changed, 0 left behind, 0 tracebacks"


def _sweep(tmp_path: Path, *args: str, timeout: int) -> str:
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    out = tmp_path / "sweep.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kill_rerun_sweep.py"),
                          "--out", str(out), *args], capture_output=True, text=True,
                         timeout=timeout, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out.read_text()


def test_a_killed_share_compress_reruns_to_the_same_result(tmp_path) -> None:
    text = _sweep(tmp_path, "--cases", "compress", "--seeds", "1", timeout=300)
    assert f"1 cases, {CLEAN}" in text
    assert "| compress | " in text


@pytest.mark.slow
def test_every_writing_command_survives_a_kill_and_rerun(tmp_path) -> None:
    text = _sweep(tmp_path, timeout=3600)
    assert CLEAN in text
    assert int(text.split("\n\n")[2].split()[0]) >= 16  # 8 commands x 2 kill points
