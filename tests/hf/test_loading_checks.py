"""A model folder that would generate garbage is refused by name when it is loaded:
missing tensors, wrongly shaped tensors, non-finite weights."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from structlm.hf.loading import load_model  # noqa: E402
from tiny_models import tiny_llama  # noqa: E402


def _save(folder, model) -> None:
    model.save_pretrained(folder)


def test_missing_tensors_are_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    _save(tmp_path, tiny_llama())
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    dropped = sorted(k for k in state if "layers.1.mlp" in k)
    save_file({k: v for k, v in state.items() if k not in dropped}, str(path),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 3 tensors .*layers.1.mlp"):
        load_model(str(tmp_path))


def test_wrong_shapes_are_refused(tmp_path) -> None:
    _save(tmp_path, tiny_llama())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] += 8  # config no longer matches the weights
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"wrongly shaped|lacks"):
        load_model(str(tmp_path))


def test_non_finite_weights_are_refused(tmp_path) -> None:
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = float("nan")
    _save(tmp_path, model)
    with pytest.raises(ValueError, match=r"non-finite weights .*layers.0.self_attn.q_proj"):
        load_model(str(tmp_path))


def test_a_complete_folder_loads(tmp_path) -> None:
    _save(tmp_path, tiny_llama())
    assert load_model(str(tmp_path)).model is not None
