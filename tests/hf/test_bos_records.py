"""One BOS decision per model, applied by every sampling mode and recorded as applied.

A tokenizer that puts BOS before every input (Gemma's convention) gets BOS first in every
scored window — drawn windows and a token stream (``--sampling head``) alike — and every
record (``eval ppl``'s line and ``--json``, :func:`evaluate_all`'s records, the text
descriptions) says so with the id; one that puts none gets none. The records are checked
against the ``input_ids`` the model's forward actually received."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm.cli import main  # noqa: E402
from structlm.hf import loading  # noqa: E402
from structlm.hf.bos import decide_bos  # noqa: E402
from structlm.hf.perplexity import perplexity  # noqa: E402
from structlm.hf.pipeline import evaluate_all, prepare  # noqa: E402
from structlm.hf.text import split_corpus, token_stream, window_prefix  # noqa: E402
from tiny_models import tiny_family, tiny_llama  # noqa: E402

WORDS = ("truth universally acknowledged single man possession good fortune want wife "
         "handsome clever rich comfortable home happy disposition family estate Sussex "
         "residence Norland Park baronet amusement book").split()


def _corpus(folder: Path, docs: int = 4, words: int = 900) -> str:
    """``docs`` text files of seeded random words (every document different)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for i in range(docs):
        (folder / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(words)))
    return str(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A corpus; a Gemma 2 model whose tokenizer puts ``<bos>`` before every input; a
    LLaMA whose tokenizer puts nothing (both tokenizers BPEs trained here)."""
    from tokenizers.processors import TemplateProcessing

    from structlm.data.bpe import train_bpe

    root = tmp_path_factory.mktemp("bos")
    corpus = _corpus(root / "texts")
    texts = [p.read_text() for p in sorted(Path(corpus).iterdir())]
    tok = train_bpe(texts, 300, root / "bpe")
    tiny_llama(vocab_size=300).save_pretrained(root / "plain")
    tok.save_pretrained(root / "plain")
    tok.add_special_tokens({"bos_token": "<bos>"})
    bos = tok.convert_tokens_to_ids("<bos>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", bos)])
    tiny_family("gemma2", vocab_size=301, bos_token_id=bos, eos_token_id=0,
                pad_token_id=0).save_pretrained(root / "gemma")
    tok.save_pretrained(root / "gemma")
    return {"corpus": corpus, "gemma": str(root / "gemma"), "plain": str(root / "plain"),
            "bos": str(bos)}


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every ``input_ids`` batch the next loaded model's embedding reads."""
    seen: list[torch.Tensor] = []
    real = loading.load_model

    def load(*args: Any, **kwargs: Any) -> Any:
        loaded = real(*args, **kwargs)
        loaded.model.get_input_embeddings().register_forward_hook(
            lambda _m, inp, _out: seen.append(inp[0].detach().clone()))
        return loaded

    monkeypatch.setattr(loading, "load_model", load)
    return seen


def test_the_decision_follows_the_tokenizer_and_the_flag(models: dict[str, str]) -> None:
    gemma = loading.load_model(models["gemma"], weights=False).tokenizer
    plain = loading.load_model(models["plain"], weights=False).tokenizer
    bos = int(models["bos"])
    assert window_prefix(gemma) == [bos] and window_prefix(plain) == []
    auto = decide_bos(gemma)
    assert (auto.bos_id, auto.convention, auto.prefix(), auto.warning) == (bos, True, [bos], "")
    assert decide_bos(gemma, True).prefix() == [bos]  # asked and conventional: one BOS
    off = decide_bos(gemma, False, model="g")
    assert off.bos_id is None and off.prefix() == [] and "--no-bos" in off.warning
    assert decide_bos(plain).bos_id is None and decide_bos(plain).prefix() == []
    forced = decide_bos(plain, True)
    assert forced.bos_id == plain.bos_token_id == 0 and forced.prefix() == [0]
    assert not decide_bos(plain, False).warning
    plain.bos_token = None
    with pytest.raises(ValueError, match="--bos: the tokenizer of 'p' has no BOS token"):
        decide_bos(plain, True, model="'p'")


@pytest.mark.parametrize("which", ["gemma", "plain"])
@pytest.mark.parametrize("sampling", ["windows", "head"])
@pytest.mark.parametrize("flag", [[], ["--bos"], ["--no-bos"]])
def test_eval_ppl_records_the_bos_it_scored(models: dict[str, str], which: str,
                                            sampling: str, flag: list[str],
                                            monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    seen = _spy(monkeypatch)
    assert main(["eval", "ppl", models[which], "--corpus", models["corpus"], "--tokens", "150",
                 "--window", "32", "--sampling", sampling, "--batch-size", "3", "--json",
                 *flag]) == 0
    captured = capsys.readouterr()
    rec = json.loads(captured.out)
    bos = int(models["bos"]) if which == "gemma" else 0
    want = flag == ["--bos"] or (which == "gemma" and not flag)
    assert rec["bos"] is want and rec["bos_id"] == (bos if want else None)
    assert rec["bos_decision"]["bos_id"] == rec["bos_id"]
    firsts = torch.cat([ids[:, 0] for ids in seen])  # the first input of every window
    assert len(seen) >= 2 and firsts.numel() == rec["windows"]
    if want:
        assert bool((firsts == bos).all())
    else:
        assert not bool((firsts == bos).any())
    if which == "gemma":  # its BOS is no other token: exactly one per window, or none
        assert all(int((ids == bos).sum()) == (ids.shape[0] if want else 0) for ids in seen)
    warned = "structlm: warning:" in captured.err
    assert warned is (which == "gemma" and flag == ["--no-bos"])


def test_the_printed_line_names_the_bos(models: dict[str, str], capsys) -> None:
    assert main(["eval", "ppl", models["gemma"], "--corpus", models["corpus"], "--tokens",
                 "100", "--window", "32"]) == 0
    out = capsys.readouterr().out
    assert f"bos={models['bos']})" in out and "puts it before every input" in out


def test_head_sampling_equals_plain_transformers_with_bos_per_window(
        models: dict[str, str], capsys) -> None:
    """The stream's perplexity is the one plain transformers gives with BOS in front of
    every window (the head mode no longer leaves it out)."""
    assert main(["eval", "ppl", models["gemma"], "--corpus", models["corpus"], "--tokens",
                 "120", "--window", "32", "--sampling", "head", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    loaded = loading.load_model(models["gemma"])
    docs = split_corpus(models["corpus"], 0.25, 0).evaluation
    stream = token_stream(loaded.tokenizer, docs, 120)
    bos, nll, count = int(models["bos"]), 0.0, 0
    with torch.no_grad():
        for a in range(0, 120, 31):  # 31 new tokens a window; the last re-reads context
            b = min(a + 31, 120)
            ids = torch.cat([torch.tensor([bos]), stream[max(0, b - 31):b]])[None]
            logp = torch.log_softmax(loaded.model(ids).logits[0, :-1].double(), -1)
            scored = logp.gather(-1, ids[0, 1:, None])[-(b - a):]
            nll -= float(scored.sum())
            count += b - a
    assert rec["tokens"] == count == 120
    assert rec["nll"] == pytest.approx(nll / count, rel=1e-5)


def test_evaluate_all_and_the_text_records_of_prepared_windows(models: dict[str, str]) -> None:
    """What ``share compress`` and ``convert`` record: each perplexity record and each
    text description says BOS, with its id, exactly when the windows start with it."""
    for which, bos in (("gemma", int(models["bos"])), ("plain", None)):
        prep = prepare(models[which], models["corpus"], calib_tokens=128, eval_tokens=100,
                       seq_len=32, val_tokens=64, calibrate=False, progress=False)
        assert prep.bos is not None and prep.bos.bos_id == bos
        records = evaluate_all(prep.loaded.model, prep.eval_ids, window=32, progress=False)
        for name, rec in records.items():
            starts = prep.eval_ids[name][:, 0]
            assert rec["bos"] is (bos is not None) and rec["bos_id"] == bos
            assert bool((starts == bos).all()) if bos is not None else rec["bos_id"] is None
        assert all(d["bos"]["bos_id"] == bos for d in prep.text.values())


def test_perplexity_reads_the_record_from_the_ids(models: dict[str, str]) -> None:
    model = loading.load_model(models["gemma"]).model
    bos = int(models["bos"])
    torch.manual_seed(0)
    body = torch.randint(1, 300, (5, 15))
    with_bos = torch.cat([torch.full((5, 1), bos), body], 1)
    res = perplexity(model, with_bos, progress=False)  # BOS already the first id
    assert (res.bos, res.bos_id, res.tokens) == (True, bos, 5 * 15)
    put = perplexity(model, body, bos_id=bos, progress=False)  # BOS put in front
    assert (put.bos, put.bos_id) == (True, bos)
    assert put.nll == pytest.approx(res.nll, rel=1e-6)  # the same inputs, the same targets
    bare = perplexity(model, body, progress=False)
    assert (bare.bos, bare.bos_id) == (False, None) and bare.as_dict()["bos_id"] is None
    with pytest.raises(ValueError, match=f"already starts with BOS {bos}"):
        perplexity(model, with_bos, bos_id=bos, progress=False)
    stream = perplexity(model, body.reshape(-1), window=16, bos_id=bos, progress=False)
    assert (stream.bos, stream.bos_id) == (True, bos)

