"""The conversion record travels with the weights: ``save_pretrained`` of a converted
model stores it in the safetensors metadata too, so a folder whose ``config.json`` lost
(or contradicts) its record is refused by ``from_pretrained`` and ``load_converted`` —
never loaded as the dense model — and ``restore_record`` brings it back; a missing path
is named."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

from structlm import AlgebraConfig, conversion_info, convert_, load_converted  # noqa: E402
from structlm.convert import restore_record  # noqa: E402
from structlm.convert.algebra_config import CONFIG_KEY  # noqa: E402
from structlm.convert.record import restore_conversion, saved_record  # noqa: E402
from tiny_models import tiny_llama  # noqa: E402

IDS = torch.randint(1, 89, (2, 16), generator=torch.Generator().manual_seed(5))


@pytest.fixture()
def saved(tmp_path):
    """A converted tiny LLaMA saved with save_pretrained, and its logits."""
    model = convert_(tiny_llama(seed=6), AlgebraConfig("Q2^2", "cyclic", "mlp"))
    folder = tmp_path / "converted"
    model.save_pretrained(folder)
    with torch.no_grad():
        logits = model(IDS).logits
    return folder, logits


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def _write_config(folder, data: dict) -> None:
    (folder / "config.json").write_text(json.dumps(data))


def test_the_weights_carry_the_record(saved) -> None:
    folder, logits = saved
    with safe_open(str(folder / "model.safetensors"), "pt") as fh:
        meta = fh.metadata()
        assert meta["format"] == "pt"  # transformers' own metadata kept
        record = json.loads(meta[CONFIG_KEY])
    assert record == _config(folder)[CONFIG_KEY] == saved_record(folder)
    assert record["algebra"] == "Q2^2" and len(record["modules"]) == 9  # 3 layers x 3
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert conversion_info(model)["algebra"] == "Q2^2"
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, logits)  # tensors unchanged by the rewrite


def test_a_lost_record_is_refused_then_restored(saved) -> None:
    folder, logits = saved
    data = _config(folder)
    del data[CONFIG_KEY]
    _write_config(folder, data)
    for load in (transformers.AutoModelForCausalLM.from_pretrained, load_converted):
        with pytest.raises(ValueError, match=r"config.json has no 'structlm_conversion' "
                           r"record, so it would load as the DENSE model.*restore_record"):
            load(folder)
    assert restore_record(folder)["algebra"] == "Q2^2"
    model = load_converted(folder)
    assert conversion_info(model)["modules"] == saved_record(folder)["modules"]
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, logits)


def test_a_contradicting_record_is_refused(saved) -> None:
    folder, _ = saved
    data = _config(folder)
    data[CONFIG_KEY]["algebra"] = "Q4"
    _write_config(folder, data)
    with pytest.raises(ValueError, match=r"differs from the one saved with the weights in "
                       r"\['algebra'\]"):
        transformers.AutoModelForCausalLM.from_pretrained(folder)


def test_a_dense_folder_and_an_unconverted_save_carry_no_record(tmp_path) -> None:
    tiny_llama().save_pretrained(tmp_path / "dense")
    assert saved_record(tmp_path / "dense") is None
    assert conversion_info(transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "dense")) is None
    with pytest.raises(ValueError, match="carry no 'structlm_conversion' record"):
        restore_record(tmp_path / "dense")


def test_load_converted_names_a_missing_path(tmp_path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=f"cannot read a saved model at '{missing}'"):
        load_converted(missing)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        load_converted(tmp_path / "file")


def test_a_record_naming_absent_modules_changes_nothing() -> None:
    """``restore_conversion`` checks the recorded modules before the first change."""
    model = tiny_llama()
    record = {**AlgebraConfig("Q2^2").record(),
              "modules": ["model.layers.0.mlp.up_proj", "model.layers.9.mlp.up_proj"]}
    model.config.__dict__[CONFIG_KEY] = record
    before = [(n, p.clone()) for n, p in model.named_parameters()]
    with pytest.raises(ValueError, match="recorded converted modules"):
        restore_conversion(model)
    assert conversion_info(model) is None and model.config.__dict__[CONFIG_KEY] == record
    assert all(type(m).__name__ != "TypedAlgebraLinear" for m in model.modules())
    for (name, a), (_, b) in zip(before, model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
