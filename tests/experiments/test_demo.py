"""The demo end to end (slow: about a minute even with two training steps)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


@pytest.mark.slow
def test_demo_writes_a_report(tmp_path) -> None:
    from structlm.experiments.demo import run_demo

    report = run_demo(str(tmp_path / "demo"), steps=2, gen_tokens=8)
    text = report.read_text()
    assert "final validation loss" not in text  # the report has its own table
    assert "| dense |" in text and "| Q2^2 |" in text and "59/80" in text
    assert (tmp_path / "demo" / "loss_curves.png").stat().st_size > 1000
    assert (tmp_path / "demo" / "generate.csv").exists()
