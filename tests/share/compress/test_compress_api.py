"""``compress_``: a model in memory compressed in place as ``compress_model`` does it; a
model folder compressed layer by layer into a new folder with the same report; the
per-method options and the flat keys of before; bad input refused before any work."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from structlm.hf.adapters import get_adapter
from structlm.hf.calibration import calibrate
from structlm.hf.loading import load_model
from structlm.share.compress import CompressionConfig, compress_, compress_model
from structlm.share.compress.methods import BasisSharingOptions, HybridOptions
from tiny_models import tiny_family


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (n, 32), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer Qwen2 (GQA, biases, untied head) in small shards."""
    root = tmp_path_factory.mktemp("compress-api")
    tiny_family("qwen2", seed=5, vocab_size=300, tie_word_embeddings=False,
                num_hidden_layers=4, max_position_embeddings=256).save_pretrained(
        root / "model", max_shard_size="60KB")
    return root / "model"


@pytest.mark.parametrize("method", ["svd-llm-w", "basis-sharing", "hybrid"])
def test_in_memory_equals_compress_model(folder: Path, method: str) -> None:
    ids = _ids(6)
    cfg = CompressionConfig(method=method, types="all", target_reduction=0.3,
                            hybrid=HybridOptions(residual_rank=2))
    mine, theirs = load_model(str(folder)).model, load_model(str(folder)).model
    report = compress_(mine, cfg, ids, seq_len=32, progress=False)
    ad = get_adapter(theirs)
    cal = calibrate(ad, ids, seq_len=32, progress=False)
    assert report == compress_model(ad, cal, cfg, calib_tokens=ids)
    probe = _ids(2, seed=1)
    with torch.no_grad():
        assert torch.equal(mine(probe).logits, theirs(probe).logits)


@pytest.mark.parametrize("method", ["svd-llm-w", "basis-sharing"])
def test_folder_streams_to_the_same_report(folder: Path, tmp_path: Path, method: str) -> None:
    ids = _ids(6)
    cfg = CompressionConfig(method=method, types="all", target_reduction=0.3)
    report = compress_(str(folder), cfg, ids, out=tmp_path / "out", seq_len=32,
                       progress=False)
    whole = load_model(str(folder)).model
    assert report == compress_(whole, cfg, ids, seq_len=32, progress=False)
    streamed = load_model(str(tmp_path / "out")).model
    probe = _ids(2, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(streamed(probe).logits, whole(probe).logits,
                                   rtol=1e-6, atol=1e-6)


def test_method_name_as_config(folder: Path) -> None:
    model = load_model(str(folder)).model
    report = compress_(model, "svd-llm-w", _ids(4), seq_len=32, progress=False)
    assert report["config"]["method"] == "svd-llm-w"
    assert report["stored_parameters"] < report["original_parameters"]


def test_refused_before_any_work(folder: Path, tmp_path: Path) -> None:
    model = load_model(str(folder)).model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="needs calibration"):
        compress_(model, "svd-llm-w")
    with pytest.raises(TypeError, match="calibration must be token ids"):
        compress_(model, "svd-llm-w", [[1, 2, 3]])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a CompressionConfig"):
        compress_(model, {"method": "svd-llm-w"}, _ids(2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="give out="):
        compress_(str(folder), "svd-llm-w", _ids(2))
    with pytest.raises(ValueError, match="chooses the ranks"):
        compress_(str(folder), CompressionConfig(method="shared", target_reduction=0.3),
                  _ids(2), out=tmp_path / "x")
    assert not (tmp_path / "x").exists()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_options_and_the_flat_keys_of_before() -> None:
    new = CompressionConfig.from_dict({"method": "basis-sharing",
                                       "basis_sharing": {"group_size": 3, "update": True},
                                       "hybrid": {"residual_rank": 4}})
    assert new.basis_sharing == BasisSharingOptions(group_size=3, update=True)
    assert new.hybrid == HybridOptions(residual_rank=4)
    with pytest.warns(FutureWarning, match=r"\['group_size', 'residual_rank', 'update'\]"):
        old = CompressionConfig.from_dict({"method": "basis-sharing", "group_size": 3,
                                           "update": True, "residual_rank": 4})
    assert old == new
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a saved folder's manifest: read without a note
        assert CompressionConfig.from_dict({"method": "basis-sharing", "group_size": 3,
                                            "update": True, "residual_rank": 4},
                                           warn=False) == new
    # the cache key of results made under the flat config is unchanged
    assert new.legacy_dict() == {
        "method": "basis-sharing", "types": "attn", "k_fraction": 0.25, "ranks": {},
        "residual_rank": 4, "target_reduction": None, "eig_floor": 1e-6,
        "budget": "per_type", "group_size": 3, "shared_types": "q,k,v,mlp_in",
        "update": True}
    with pytest.raises(ValueError, match="group_size given twice"), \
            pytest.warns(FutureWarning):
        CompressionConfig.from_dict({"group_size": 3, "basis_sharing": {"group_size": 2}})
    with pytest.raises(ValueError, match="shared_types: unknown"):
        BasisSharingOptions(shared_types="q,zz")
    with pytest.raises(ValueError, match="residual_rank: -1 is out of range"):
        CompressionConfig(hybrid={"residual_rank": -1})
    with pytest.raises(ValueError, match="expected a HybridOptions or a mapping"):
        CompressionConfig(hybrid=3)  # type: ignore[arg-type]
