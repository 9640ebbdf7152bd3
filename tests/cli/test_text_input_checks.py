"""Text input and perplexity output: no needless refusal (``--split all`` on one document,
``convert`` of a model without tokenizer files when no text is used), clear messages for
bad input (a ``.jsonl`` record that is not text, a batch that cannot fit in memory), and
every command that computes a perplexity prints it."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm.cli import main  # noqa: E402
from structlm.data.corpora import load_corpus  # noqa: E402
from structlm.hf import perplexity as ppl_module  # noqa: E402
from structlm.hf.loading import load_model  # noqa: E402
from structlm.hf.perplexity import batch_memory, perplexity  # noqa: E402
from tiny_models import tiny_gpt2, tiny_llama  # noqa: E402

WORDS = ("truth universally acknowledged single man possession good fortune want wife "
         "handsome clever rich comfortable home happy disposition family estate Sussex "
         "residence Norland Park baronet amusement book").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A four-document corpus, a one-document corpus, a LLaMA with its trained BPE and the
    same LLaMA without tokenizer files."""
    from structlm.data.bpe import train_bpe

    root = tmp_path_factory.mktemp("text-input")
    rng = random.Random(1)
    (root / "four").mkdir()
    for i in range(4):
        (root / "four" / f"d{i}.txt").write_text(_text(rng, 1200))
    (root / "one").mkdir()
    (root / "one" / "only.txt").write_text(_text(rng, 1200))
    tok = train_bpe([p.read_text() for p in (root / "four").iterdir()], 300, root / "bpe")
    tiny_llama(vocab_size=300, max_position_embeddings=512).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    tiny_llama(vocab_size=300).save_pretrained(root / "notok")
    return {k: str(root / k) for k in ("four", "one", "model", "notok")} | {"root": str(root)}


def test_split_all_scores_a_one_document_corpus(files: dict[str, str], capsys) -> None:
    assert main(["eval", "ppl", files["model"], "--corpus", files["one"], "--split", "all",
                 "--tokens", "100", "--window", "32", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["documents"] == ["file/only.txt"] and rec["tokens"] >= 100
    assert 1 < rec["ppl"] < 1e4
    assert main(["eval", "ppl", files["model"], "--corpus", files["one"], "--tokens", "100",
                 "--window", "32"]) == 2  # a split still needs two documents
    assert "need at least 2" in capsys.readouterr().err


@pytest.mark.parametrize(("line", "names"), [
    ('{"text": 5}', "field 'text' must be a string of text, got int 5"),
    ('{"prompt": "Q?", "response": 3.5}', "field 'response' must be a string"),
    ('[1, 2]', "expected a JSON object"),
    ('{"text": "ok"', "not valid JSON"),
])
def test_a_jsonl_record_that_is_not_text_is_named(files: dict[str, str], line: str,
                                                  names: str, capsys) -> None:
    path = Path(files["root"]) / "rows.jsonl"
    path.write_text('{"text": "a first record of real text"}\n' + line + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}, line 2: ") + ".*"
                       + re.escape(names)):
        load_corpus(str(path))
    assert main(["eval", "ppl", files["model"], "--corpus", str(path), "--split", "all",
                 "--window", "32"]) == 2
    assert f"{path}, line 2" in capsys.readouterr().err


def test_batch_memory_is_a_lower_bound_of_the_logits() -> None:
    model = tiny_gpt2()  # the whole model is called: (b, L, V) logits and log-probabilities
    b, length, vocab, d = 3, 20, 97, 48
    assert batch_memory(model, b, length) == (b * length * vocab * 4
                                              + b * (length - 1) * vocab * 4
                                              + 2 * b * length * d * 4)
    assert batch_memory(model, 2 * b, length) == 2 * batch_memory(model, b, length)


def test_a_batch_beyond_the_memory_is_refused_before_work(files: dict[str, str],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys) -> None:
    model = tiny_gpt2()
    torch.manual_seed(0)
    windows = torch.randint(1, 97, (40, 24))
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    budget = batch_memory(model, 5, 24)  # five windows fit, six do not
    monkeypatch.setattr(ppl_module, "available_memory", lambda device: budget)
    with pytest.raises(ValueError, match=r"batch_size \(--batch-size\) 100000000: scoring 40 "
                       r"windows of 24 tokens .* use a batch size of at most 5"):
        perplexity(model, windows, batch_size=100_000_000, progress=False)
    assert not calls  # refused before any forward
    res = perplexity(model, windows, batch_size=5, progress=False)
    assert res.windows == 40 and len(calls) == 8
    assert main(["eval", "ppl", files["model"], "--corpus", files["four"], "--tokens", "200",
                 "--window", "32", "--batch-size", "100000000"]) == 2
    err = capsys.readouterr().err
    assert "(--batch-size) 100000000" in err and "needs at least" in err


def test_an_allocator_failure_while_scoring_names_the_batch_size() -> None:
    model = tiny_gpt2()

    def allocate(*_: object) -> None:
        torch.empty(1 << 62, dtype=torch.uint8)  # the allocator's own refusal

    model.register_forward_pre_hook(allocate)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"batch_size \(--batch-size\) 7: ran out of memory "
                       r"scoring 4 windows of 16 tokens"):
        perplexity(model, torch.randint(1, 97, (4, 16)), batch_size=7, progress=False)


def test_convert_needs_no_tokenizer_when_no_text_is_used(files: dict[str, str], tmp_path,
                                                         capsys) -> None:
    out = tmp_path / "converted"
    assert main(["convert", files["notok"], "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    loaded = load_model(str(out))
    assert loaded.tokenizer is None
    torch.manual_seed(0)
    ids = torch.randint(1, 300, (1, 12))
    dense = load_model(files["notok"]).model
    assert not torch.allclose(loaded.model(ids).logits, dense(ids).logits)  # converted
    assert main(["convert", files["notok"], "--out", str(tmp_path / "ev"), "--eval-tokens",
                 "100", "--corpus", files["four"], "--second-corpus", ""]) == 2
    assert "tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "ev").exists()


def test_convert_prints_every_perplexity_it_computes(files: dict[str, str], tmp_path,
                                                     capsys) -> None:
    out = tmp_path / "converted"
    assert main(["convert", files["model"], "--out", str(out), "--eval-tokens", "100",
                 "--corpus", files["four"], "--second-corpus", ""]) == 0
    printed = capsys.readouterr().out
    rep = json.loads((out / "structlm_convert.json").read_text())
    (text, before), = rep["original"]["ppl"].items()
    after = rep["converted"]["ppl"][text]
    assert before != after
    assert (f"perplexity {text} (bos=none): original {before:.2f} -> converted "
            f"{after:.2f}") in printed
    assert rep["text"][text]["bos"]["bos_id"] is None


def test_share_compress_prints_every_perplexity_it_computes(files: dict[str, str], tmp_path,
                                                           capsys) -> None:
    out = tmp_path / "compressed"
    assert main(["share", "compress", files["model"], "--out", str(out), "--corpus",
                 files["four"], "--second-corpus", "", "--calib-tokens", "512",
                 "--eval-tokens", "100", "--finetune-steps", "1", "--finetune-seq-len", "32",
                 "--finetune-batch-size", "2", "--finetune-eval-tokens", "64"]) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "compress.json").read_text())
    (text, before), = res["ppl_original"].items()
    assert (f"perplexity {text} ({before['tokens']} tokens, bos=none): original "
            f"{before['ppl']:.2f} -> compressed {res['ppl_compressed'][text]['ppl']:.2f} -> "
            f"fine-tuned {res['ppl_finetuned'][text]['ppl']:.2f}") in printed
