"""``share compress`` layer by layer (:mod:`structlm.share.compress.streamed`,
:mod:`structlm.share.compress.run_streamed`) against the whole-model run: the same report
and the same per-window sums, bitwise; a killed run resumes at its first unfinished unit;
the sharded folder loads and generates; what cannot stream is refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from structlm.hf.layer_stream import StreamedModel
from structlm.hf.loading import load_model
from structlm.share.compress import CompressionConfig
from structlm.share.compress import streamed as streamed_module
from structlm.share.compress.run import run_compress
from tiny_models import tiny_family

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch".split()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A 4-layer Qwen2 (untied head, biases; GQA) in per-layer shards with a BPE trained
    on a small random-word corpus."""
    from structlm.data.bpe import train_bpe

    root = tmp_path_factory.mktemp("streamed-compress")
    docs = root / "texts"
    docs.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        picks = torch.randint(0, len(WORDS), (2500,), generator=g).tolist()
        (docs / f"doc{i}.txt").write_text(" ".join(WORDS[j] for j in picks))
    tok = train_bpe([p.read_text() for p in sorted(docs.iterdir())], 300, root / "bpe")
    tiny_family("qwen2", seed=2, vocab_size=300, tie_word_embeddings=False,
                num_hidden_layers=4, max_position_embeddings=512).save_pretrained(
        root / "model", max_shard_size="60KB")
    tok.save_pretrained(root / "model")
    return {"model": str(root / "model"), "corpus": str(docs), "root": str(root)}


def _run(setup: dict[str, str], cfg: CompressionConfig, out: str, stream: str) -> dict:
    return run_compress(setup["model"], cfg, Path(setup["root"]) / out,
                        corpus=setup["corpus"], second_corpus="", calib_tokens=2048,
                        eval_tokens=1024, progress=False, stream=stream)


@pytest.mark.parametrize("method", ["svd-llm-w", "basis-sharing"])
def test_streamed_equals_whole_bitwise(setup: dict[str, str], method: str) -> None:
    cfg = CompressionConfig(method=method, types="all", target_reduction=0.3)
    whole = _run(setup, cfg, f"{method}-whole", "off")
    streamed = _run(setup, cfg, f"{method}-streamed", "on")
    assert streamed["layer_streamed"] is True and "layer_streamed" not in whole
    assert streamed["compression"] == whole["compression"]  # ranks, energies, accounting
    for key in ("ppl_original", "ppl_compressed"):
        for text, rec in whole[key].items():
            assert streamed[key][text]["window_nll"] == rec["window_nll"], (key, text)
            assert streamed[key][text]["windows_sha1"] == rec["windows_sha1"]
    assert streamed["text"] == whole["text"]
    folder = Path(setup["root"]) / f"{method}-streamed" / "model"
    manifest = json.loads((folder / "structlm_compression.json").read_text())
    assert manifest["format"] == 3 and manifest["streamed"] is True
    shards = sorted(p.name for p in folder.glob("structlm_compressed-layer*.safetensors"))
    assert len(shards) == (4 if method == "svd-llm-w" else 2)  # units: 1 layer / 2 layers
    # the folder loads whole and runs like the model compressed in memory
    mine = load_model(str(folder)).model
    theirs = load_model(str(Path(setup["root"]) / f"{method}-whole" / "model")).model
    ids = torch.randint(3, 300, (2, 17))
    with torch.no_grad():
        assert torch.equal(mine(ids).logits, theirs(ids).logits)
        out = mine.generate(ids[:1, :5], max_new_tokens=4, do_sample=False,
                            pad_token_id=0)
    assert out.shape == (1, 9)
    if method == "basis-sharing":  # a basis shared by two layers is stored once
        index = json.loads((folder / "structlm_compressed.safetensors.index.json"
                            ).read_text())
        assert index["aliases"] and all(a not in index["weight_map"] for a in index["aliases"])
        mod = load_model(str(folder)).model.model.layers
        shared = [n for n, _ in mod[0].named_parameters() if "basis" in n]
        assert shared and all(
            mod[0].get_parameter(n) is mod[1].get_parameter(n) for n in shared)


def test_a_killed_run_resumes_at_its_first_unfinished_unit(
        setup: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = CompressionConfig(method="svd-llm-w", types="attn", target_reduction=0.25)
    real = streamed_module._compress_unit
    done: list[int] = []

    def killed_at_unit_2(stream, cal, cfg, plans, unit, work):
        if unit == [2] and 2 not in done:
            done.append(2)
            raise KeyboardInterrupt
        done.append(unit[0])
        return real(stream, cal, cfg, plans, unit, work)

    monkeypatch.setattr(streamed_module, "_compress_unit", killed_at_unit_2)
    with pytest.raises(KeyboardInterrupt):
        _run(setup, cfg, "resumed", "on")
    partial = Path(setup["root"]) / "resumed" / ".partial-model"
    assert sorted(p.name for p in partial.glob("unit-*.json")) == [
        "unit-000-000.json", "unit-001-001.json"]
    resumed = _run(setup, cfg, "resumed", "on")
    assert done == [0, 1, 2, 2, 3]  # units 0 and 1 not redone
    fresh = _run(setup, cfg, "fresh", "on")
    assert resumed["compression"] == fresh["compression"]
    text = next(iter(fresh["ppl_compressed"]))
    assert resumed["ppl_compressed"][text]["window_nll"] == \
        fresh["ppl_compressed"][text]["window_nll"]
    assert not partial.exists()


@pytest.mark.parametrize(("cfg", "match"), [
    (CompressionConfig(method="svd-llm", types="attn", target_reduction=0.2),
     "refits every layer on the compressed model's own inputs"),
    (CompressionConfig(method="basis-sharing", types="attn", target_reduction=0.2,
                       basis_sharing={"update": True}), "with update refits every layer"),
    (CompressionConfig(method="shared", types="attn", target_reduction=0.2),
     "chooses the ranks of q from every layer's data"),
    (CompressionConfig(method="onesided-all-layers", types="attn", target_reduction=0.2),
     "shares one basis across all 4 layers"),
])
def test_what_cannot_stream_is_refused_with_the_reason(setup: dict[str, str],
                                                       cfg: CompressionConfig,
                                                       match: str, tmp_path: Path) -> None:
    from structlm.hf.calibration import Calibration
    from structlm.hf.loading import LoadedModel

    stream = StreamedModel(setup["model"])
    with pytest.raises(ValueError, match=match):
        streamed_module.compress_streamed(stream, Calibration(meta={}), cfg, tmp_path / "m",
                                          LoadedModel(stream.model, None, "x"), {}, None,
                                          progress=False)
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_fine_tuning_with_stream_on_is_refused(setup: dict[str, str], tmp_path: Path) -> None:
    from structlm.hf.finetune import FinetuneConfig

    with pytest.raises(ValueError, match="fine-tuning holds the whole model"):
        run_compress(setup["model"], CompressionConfig(method="svd-llm-w"), tmp_path / "o",
                     corpus=setup["corpus"], ft=FinetuneConfig(steps=5), stream="on",
                     progress=False)
    assert not (tmp_path / "o").exists()


def test_stream_units() -> None:
    from structlm.hf.adapters import MatrixType
    from structlm.share.compress.methods import TypePlan

    def plan(groups: list[list[int]]) -> TypePlan:
        return TypePlan(MatrixType.Q, "x", (4, 4), None, None, groups, 1)

    per_layer = plan([[0], [1], [2], [3], [4]])
    pairs = plan([[0, 1], [2, 3], [4]])
    assert streamed_module.stream_units([per_layer], 5) == [[0], [1], [2], [3], [4]]
    assert streamed_module.stream_units([per_layer, pairs], 5) == [[0, 1], [2, 3], [4]]
    assert streamed_module.stream_units([plan([[0, 1, 2], [3, 4]]), pairs], 5) == [
        [0, 1, 2, 3, 4]]


def test_eval_ppl_streams_a_sharded_compressed_folder(setup: dict[str, str], capsys) -> None:
    """``eval ppl --stream on`` reads a folder written layer by layer one layer at a time
    (its factorised modules included) and gives the numbers of the folder loaded whole."""
    from structlm.cli import main

    cfg = CompressionConfig(method="basis-sharing", types="mlp", target_reduction=0.3)
    _run(setup, cfg, "for-eval", "on")
    folder = str(Path(setup["root"]) / "for-eval" / "model")
    records = {}
    for mode in ("on", "off"):
        assert main(["eval", "ppl", folder, "--corpus", setup["corpus"], "--tokens", "300",
                     "--window", "40", "--json", "--stream", mode]) == 0
        records[mode] = json.loads(capsys.readouterr().out)
    assert records["on"]["layer_streamed"] and not records["off"]["layer_streamed"]
    assert records["on"]["window_nll"] == records["off"]["window_nll"]
    with pytest.raises(ValueError, match="is a compressed folder: compress the model"):
        run_compress(folder, cfg, Path(setup["root"]) / "again", corpus=setup["corpus"],
                     stream="on", progress=False)


def test_auto_streams_what_can_and_runs_the_rest_whole(setup: dict[str, str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the size threshold ``--stream auto`` streams a method that can and runs one
    that cannot (``svd-llm``'s update) on the whole model; ``--stream on`` refuses it."""
    from structlm.hf import layer_stream

    monkeypatch.setattr(layer_stream, "STREAM_ABOVE_BYTES", 0)  # every folder is "large"
    streams = _run(setup, CompressionConfig(method="svd-llm-w", types="attn",
                                            target_reduction=0.2), "auto-w", "auto")
    assert streams["layer_streamed"] is True
    cfg = CompressionConfig(method="svd-llm", types="attn", target_reduction=0.2)
    whole = _run(setup, cfg, "auto-llm", "auto")
    assert "layer_streamed" not in whole and whole["compression"]["update"]
    with pytest.raises(ValueError, match=r"--stream on: method 'svd-llm' refits every layer"):
        _run(setup, cfg, "on-llm", "on")


def test_a_pair_of_layers_streams_but_one_basis_over_every_layer_does_not() -> None:
    """A 2-layer model under Basis Sharing's pairs is one unit (it streams); the all-layers
    one-sided basis is refused at any depth."""
    from structlm.hf.adapters import get_adapter
    from structlm.share.compress.apply import plan_types

    for layers in (2, 4):
        adapter = get_adapter(tiny_family("qwen2", num_hidden_layers=layers))
        pairs = CompressionConfig(method="basis-sharing", types="all", target_reduction=0.2)
        every = CompressionConfig(method="onesided-all-layers", types="all",
                                  target_reduction=0.2)
        assert streamed_module.why_not_streamed(pairs, plan_types(adapter, pairs),
                                                layers) is None
        assert "shares one basis across all" in streamed_module.why_not_streamed(
            every, plan_types(adapter, every), layers)


def test_original_perplexity_is_cached_on_content(setup: dict[str, str], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The uncompressed model's streamed perplexity is cached on the weights' content and
    the windows' content: a second call reads it back equal; other windows get their own
    entry; a damaged entry is computed again (and replaced), not trusted."""
    from structlm.hf.loading import model_content_key
    from structlm.share.compress.run_streamed import evaluate_streamed, original_perplexity

    monkeypatch.setenv("STRUCTLM_CACHE", str(tmp_path / "cache"))
    key = model_content_key(setup["model"])
    assert key is not None
    folder = Path(setup["model"])
    ids = {"a": torch.randint(3, 300, (3, 16), generator=torch.Generator().manual_seed(1))}
    first = original_perplexity(key, folder, ids, False)
    entries = sorted((tmp_path / "cache" / "perplexity").glob("streamed-*.json"))
    assert len(entries) == 1
    assert first == json.loads(json.dumps(evaluate_streamed(folder, ids, False)))
    assert original_perplexity(key, folder, ids, False) == first  # read back
    entries[0].write_text("{not json")
    assert original_perplexity(key, folder, ids, False) == first  # recomputed
    assert json.loads(entries[0].read_text()) == first
    other = {"a": ids["a"].flip(0)}
    original_perplexity(key, folder, other, False)
    assert len(list((tmp_path / "cache" / "perplexity").glob("streamed-*.json"))) == 2
    assert original_perplexity(None, folder, ids, False) == first  # no key: not cached
    assert len(list((tmp_path / "cache" / "perplexity").glob("streamed-*.json"))) == 2
