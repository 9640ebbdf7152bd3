"""Layer streaming (:mod:`structlm.hf.layer_stream`) against the model run whole: the
same per-window sums bitwise, on sharded and single-file folders, tied and untied heads,
biases, awkward window counts and lengths; the route decision and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from structlm.cli import main
from structlm.hf.layer_stream import (
    StreamedModel,
    WeightFolder,
    stream_folder,
    streamed_perplexity,
)
from structlm.hf.loading import load_model
from structlm.hf.perplexity import perplexity
from tiny_models import tiny_family, tiny_gpt2, tiny_llama


def _save(model: torch.nn.Module, folder: Path, shard: str | None) -> str:
    kwargs = {} if shard is None else {"max_shard_size": shard}
    model.save_pretrained(folder, **kwargs)
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("stream")
    return {
        "llama-tied-sharded": _save(tiny_llama(seed=3, num_hidden_layers=5), root / "a",
                                    "20KB"),
        "llama-tied-one-file": _save(tiny_llama(seed=4), root / "b", None),
        "qwen2-untied-bias": _save(tiny_family("qwen2", seed=5, tie_word_embeddings=False),
                                   root / "c", "30KB"),
        "gpt2": _save(tiny_gpt2(seed=6), root / "d", None),
    }


@pytest.mark.parametrize("name", ["llama-tied-sharded", "llama-tied-one-file",
                                  "qwen2-untied-bias"])
@pytest.mark.parametrize(("n", "w", "batch"), [(1, 2, 4), (7, 33, 3), (5, 64, 5)])
def test_streamed_equals_whole_bitwise(folders: dict[str, str], name: str, n: int, w: int,
                                       batch: int) -> None:
    folder = folders[name]
    vocab = 89 if name.startswith("llama") else 97
    torch.manual_seed(n * w)
    rows = torch.randint(3, vocab, (n, w))
    rows[:, 0] = 1  # BOS first in every window (the models' bos_token_id)
    whole = perplexity(load_model(folder).model, rows, batch_size=batch, progress=False)
    streamed = streamed_perplexity(StreamedModel(folder), rows, batch_size=batch,
                                   progress=False)
    assert streamed.window_nll == whole.window_nll  # bitwise, window by window
    assert (streamed.ppl, streamed.tokens, streamed.windows, streamed.windows_sha1,
            streamed.bos, streamed.bos_id) == (whole.ppl, whole.tokens, whole.windows,
                                               whole.windows_sha1, whole.bos, whole.bos_id)
    assert whole.tokens == n * (w - 1) and 1.0 < whole.ppl < 10 * vocab


def test_only_one_layer_is_resident_at_a_time(folders: dict[str, str]) -> None:
    stream = StreamedModel(folders["llama-tied-sharded"])
    assert all(p.is_meta for b in stream.blocks for p in b.parameters())
    assert stream.embedding.weight.is_meta and stream.head.weight.is_meta
    rows = torch.randint(3, 89, (2, 9))
    inputs = stream.capture([rows])
    seen = []
    for i in range(stream.num_layers):
        with stream.resident(stream.blocks[i]):
            seen.append([j for j, b in enumerate(stream.blocks)
                         if not any(p.is_meta for p in b.parameters())])
        stream.run_layer(i, inputs)
    assert seen == [[i] for i in range(stream.num_layers)]
    assert all(p.is_meta for b in stream.blocks for p in b.parameters())
    assert inputs[0].hidden.shape == (2, 9, 32) and torch.isfinite(inputs[0].hidden).all()


def test_a_family_without_a_plain_head_is_refused_by_name(folders: dict[str, str]) -> None:
    rows = torch.randint(0, 97, (2, 8))
    with pytest.raises(ValueError, match=r"plain-head families.*'gpt2'"):
        streamed_perplexity(StreamedModel(folders["gpt2"]), rows, progress=False)
    with pytest.raises(ValueError, match=r"cannot be streamed.*'gpt2'"):
        stream_folder(folders["gpt2"], "on")
    assert stream_folder(folders["gpt2"], "auto") is None


def test_the_route_decision(folders: dict[str, str], tmp_path: Path) -> None:
    folder = folders["llama-tied-one-file"]
    assert stream_folder(folder, "off") is None
    assert stream_folder(folder, "auto") is None  # kilobytes: whole is fine
    assert stream_folder(folder, "on") == Path(folder)
    with pytest.raises(ValueError, match=r"cannot be streamed.*not a local folder"):
        stream_folder("someone/some-hub-model", "on")
    with pytest.raises(ValueError, match="stream must be auto, on or off, got 'yes'"):
        stream_folder(folder, "yes")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no safetensors weights"):
        stream_folder(str(tmp_path), "on")


def test_weight_folder_names_what_is_missing(folders: dict[str, str], tmp_path: Path) -> None:
    weights = WeightFolder(folders["llama-tied-sharded"])
    index = json.loads((Path(folders["llama-tied-sharded"])
                        / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weights.file_of) == set(index) and len(set(index.values())) > 1
    with pytest.raises(KeyError, match=r"no tensor 'model.layers.99.mlp.up_proj.weight'"):
        weights.read(["model.layers.99.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match="holds no safetensors weights"):
        WeightFolder(tmp_path)


def test_eval_ppl_streams_with_the_same_numbers(tmp_path: Path, capsys) -> None:
    """``eval ppl --stream on`` and ``--stream off`` print the same record (but the
    route), with the model's real tokenizer and text."""
    from structlm.data.bpe import train_bpe

    docs = tmp_path / "texts"
    docs.mkdir()
    words = "the quick brown fox jumps over a lazy dog while seven wise owls watch".split()
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        picks = torch.randint(0, len(words), (700,), generator=g).tolist()
        (docs / f"doc{i}.txt").write_text(" ".join(words[j] for j in picks))
    tok = train_bpe([p.read_text() for p in sorted(docs.iterdir())], 300, tmp_path / "bpe")
    folder = tmp_path / "model"
    tiny_family("qwen2", seed=2, vocab_size=300, tie_word_embeddings=False).save_pretrained(
        folder, max_shard_size="30KB")
    tok.save_pretrained(folder)
    records = {}
    for mode in ("on", "off"):
        assert main(["eval", "ppl", str(folder), "--corpus", str(docs), "--tokens", "300",
                     "--window", "40", "--batch-size", "3", "--json", "--stream", mode]) == 0
        records[mode] = json.loads(capsys.readouterr().out)
    assert records["on"].pop("layer_streamed") is True
    assert records["off"].pop("layer_streamed") is False
    assert records["on"] == records["off"] and records["on"]["tokens"] >= 300
    assert main(["eval", "ppl", str(folder), "--corpus", str(docs), "--tokens", "100",
                 "--sampling", "head", "--stream", "on"]) != 0
    assert "--sampling head runs the model whole: use --stream off" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["llama-tied-sharded", "qwen2-untied-bias"])
def test_weights_by_type_read_one_module_at_a_time(folders: dict[str, str],
                                                   name: str) -> None:
    """``StreamedModel.type_weights(t)`` gives, layer by layer, exactly what the adapter of
    the whole model gives (the stacked ``[gate; up]`` of MLP-in too), with only the
    modules of that type resident while it is read."""
    from structlm.hf.adapters import MATRIX_TYPES, get_adapter

    folder = folders[name]
    whole = get_adapter(load_model(folder).model)
    stream = StreamedModel(folder)
    for t in MATRIX_TYPES:
        lazy = stream.type_weights(t)
        assert list(lazy) == list(range(whole.num_layers)) and len(lazy) == whole.num_layers
        for i, W in zip(lazy, whole.weights(t), strict=True):
            got = lazy[i]
            assert got.dtype == torch.float32 and torch.equal(got, W), (t, i)
    assert all(p.is_meta for b in stream.blocks for p in b.parameters())  # released
    some = stream.type_weights(MATRIX_TYPES[0], [2, 0])
    assert list(some) == [2, 0]
    with pytest.raises(KeyError):
        some[1]
    with pytest.raises(ValueError, match=r"layers \[9\] out of range"):
        stream.type_weights(MATRIX_TYPES[0], [9])
