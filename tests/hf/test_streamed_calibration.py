"""Calibration layer by layer (:mod:`structlm.hf.streamed_calibration`): the moments of
:func:`~structlm.hf.calibration.calibrate` bitwise, and a run killed part-way resumes
after its last finished layer with the same result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from structlm.hf import streamed_calibration
from structlm.hf.adapters import get_adapter
from structlm.hf.calibration import SITES, calibrate
from structlm.hf.layer_stream import StreamedModel
from structlm.hf.loading import load_model
from structlm.hf.streamed_calibration import calibrate_streamed
from tiny_models import tiny_family


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("cal") / "qwen2"
    tiny_family("qwen2", seed=7, num_hidden_layers=4, tie_word_embeddings=False
                ).save_pretrained(out, max_shard_size="40KB")
    return str(out)


def _tokens(n: int, w: int) -> torch.Tensor:
    torch.manual_seed(n + w)
    return torch.randint(3, 97, (n, w))


@pytest.mark.parametrize(("n", "w", "batch"), [(1, 7, 4), (7, 33, 3)])
def test_streamed_moments_equal_the_whole_model_bitwise(folder: str, tmp_path: Path, n: int,
                                                        w: int, batch: int) -> None:
    tokens = _tokens(n, w)
    whole = calibrate(get_adapter(load_model(folder).model), tokens, seq_len=w,
                      batch_size=batch, progress=False)
    streamed = calibrate_streamed(StreamedModel(folder), tokens, tmp_path / "c", seq_len=w,
                                  batch_size=batch, progress=False, meta={"corpus": "x"})
    assert set(streamed.second_moments) == set(whole.second_moments) == {
        (i, s) for i in range(4) for s in SITES}
    for key in whole.second_moments:
        assert torch.equal(streamed.second_moments[key], whole.second_moments[key]), key
        assert torch.equal(streamed.means[key], whole.means[key]), key
        assert streamed.second_moments[key].dtype == torch.float64
    assert streamed.meta["tokens_used"] == whole.meta["tokens_used"] == n * w
    assert streamed.meta["corpus"] == "x" and streamed.meta["streamed"] is True


def test_a_killed_run_resumes_after_its_last_layer(folder: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = _tokens(5, 16)
    out = tmp_path / "c"
    real = streamed_calibration._layer_moments
    calls: list[int] = []

    def killed_at_layer_2(stream, i, inputs, sites):
        if i == 2 and not calls.count(2):
            calls.append(i)
            raise KeyboardInterrupt
        calls.append(i)
        return real(stream, i, inputs, sites)

    monkeypatch.setattr(streamed_calibration, "_layer_moments", killed_at_layer_2)
    with pytest.raises(KeyboardInterrupt):
        calibrate_streamed(StreamedModel(folder), tokens, out, seq_len=16, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "carry.safetensors", "layer-000.safetensors", "layer-001.safetensors"]
    resumed = calibrate_streamed(StreamedModel(folder), tokens, out, seq_len=16,
                                 progress=False)
    assert calls == [0, 1, 2, 2, 3]  # layers 0 and 1 not recomputed
    fresh = calibrate_streamed(StreamedModel(folder), tokens, tmp_path / "fresh", seq_len=16,
                               progress=False)
    for key in fresh.second_moments:
        assert torch.equal(resumed.second_moments[key], fresh.second_moments[key]), key
    assert not (out / "carry.safetensors").exists()
    calls.clear()
    with pytest.raises(KeyboardInterrupt):  # killed at layer 2 again, in another folder
        calibrate_streamed(StreamedModel(folder), tokens, tmp_path / "other", seq_len=16,
                           progress=False)
    with pytest.raises(ValueError, match="part-done calibration of other windows"):
        calibrate_streamed(StreamedModel(folder), _tokens(5, 17)[:, :16], tmp_path / "other",
                           seq_len=16, progress=False)
