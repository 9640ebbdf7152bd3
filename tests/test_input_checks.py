"""Bad input is refused at the boundary; a saved model loads after ``import structlm``."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from structlm.cli_share import _layers
from structlm.share.pipeline import check_layers


@pytest.mark.parametrize(("text", "match"), [
    ("0,0,1", r"repeat \[0\]"),
    ("0-3,2", r"repeat \[2\]"),
    ("5-2", "empty layer range"),
    ("a,b", "bad layer list"),
])
def test_bad_layer_lists_are_refused_at_parse(text: str, match: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=match):
        _layers(text)


def test_layer_range_is_checked_against_the_model() -> None:
    assert _layers("0-2,10") == [0, 1, 2, 10]
    with pytest.raises(ValueError, match=r"layers \[30\] are out of range: .*\[0, 30\)"):
        check_layers([0, 29, 30], 30)


def test_import_structlm_registers_the_model_with_transformers(tmp_path) -> None:
    pytest.importorskip("transformers")
    from structlm.models import StructLMForCausalLM, config_from_preset

    StructLMForCausalLM(config_from_preset("tiny")).save_pretrained(tmp_path)
    code = ("import structlm\nfrom transformers import AutoModelForCausalLM\n"
            f"print(type(AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    assert out.stdout.strip().endswith("StructLMForCausalLM")
