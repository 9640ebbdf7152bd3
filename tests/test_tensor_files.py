"""``write_safetensors`` and ``read_safetensors`` against the ``safetensors`` library: every
dtype, 0-dim, empty and non-contiguous tensors, metadata; bad input and bad files
refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from structlm.tensor_files import read_safetensors, write_safetensors

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 50
    if dtype == torch.bool:
        return x > 0
    return x.to(dtype)


def test_read_back_by_safetensors(tmp_path: Path) -> None:
    tensors = {f"t{i}.{str(d).split('.')[-1]}": _tensor(d, shape, i)
               for i, (d, shape) in enumerate(
                   (d, s) for d in DTYPES for s in [(7,), (1, 97), (3, 5, 2)])}
    tensors["scalar"] = torch.tensor(3.25, dtype=torch.float64)
    tensors["empty"] = torch.zeros(0, 4)
    tensors["transposed"] = torch.randn(5, 3).T  # not contiguous
    tensors["nan"] = torch.tensor([float("nan"), float("inf"), -0.0, 1.5])
    path = tmp_path / "a.safetensors"
    write_safetensors(tensors, path, {"layer": "7", "note": "ä"})
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert torch.equal(back[k].reshape(-1).view(torch.uint8),  # bitwise (NaN too)
                           v.contiguous().reshape(-1).view(torch.uint8)), k
    with safe_open(str(path), framework="pt") as fh:
        assert fh.metadata() == {"layer": "7", "note": "ä"}
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0  # the data starts 8-byte aligned


def test_without_metadata_and_empty_mapping(tmp_path: Path) -> None:
    write_safetensors({"x": torch.arange(6)}, tmp_path / "b.safetensors")
    assert torch.equal(load_file(str(tmp_path / "b.safetensors"))["x"], torch.arange(6))
    write_safetensors({}, tmp_path / "c.safetensors")
    assert load_file(str(tmp_path / "c.safetensors")) == {}


def test_bad_input_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"dtype torch\.complex64"):
        write_safetensors({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "z")
    with pytest.raises(ValueError, match="metadata values must be strings"):
        write_safetensors({"x": torch.ones(1)}, tmp_path / "m", {"layer": 3})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="is on meta"):
        write_safetensors({"x": torch.ones(1, device="meta")}, tmp_path / "d")


def test_read_matches_safetensors_bitwise(tmp_path: Path) -> None:
    """Files written by ``safetensors`` itself, read by ``read_safetensors``: every dtype
    and shape bitwise (NaN, -0.0 and Inf included), a subset by name, in the asked order."""
    from safetensors.torch import save_file

    tensors = {f"t{i}": _tensor(d, shape, 100 + i) for i, (d, shape) in enumerate(
        (d, s) for d in DTYPES for s in [(1,), (7, 97), (2, 3, 1025)])}
    tensors["scalar"] = torch.tensor(-0.0, dtype=torch.float64)
    tensors["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    tensors["nan"] = torch.tensor([float("nan"), float("-inf"), -0.0, 1.5])
    path = tmp_path / "s.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    back = read_safetensors(path)
    assert list(back) == list(load_file(str(path)))
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert torch.equal(back[k].reshape(-1).view(torch.uint8),
                           v.reshape(-1).view(torch.uint8)), k
    some = read_safetensors(path, ["nan", "t3"])
    assert list(some) == ["nan", "t3"] and torch.equal(some["t3"], tensors["t3"])
    assert some["t3"].dtype == torch.float32
    some["t3"].add_(1)  # a tensor of its own: the file is not changed through it
    assert torch.equal(read_safetensors(path, ["t3"])["t3"], tensors["t3"])


def test_read_refuses_missing_names_and_broken_files(tmp_path: Path) -> None:
    path = tmp_path / "r.safetensors"
    write_safetensors({"x": torch.arange(10, dtype=torch.float32)}, path)
    with pytest.raises(KeyError, match="no tensor 'y'"):
        read_safetensors(path, ["y"])
    data = path.read_bytes()
    (tmp_path / "short").write_bytes(data[:-8])  # the last two floats cut off
    with pytest.raises(ValueError, match="data offsets"):
        read_safetensors(tmp_path / "short")
    (tmp_path / "junk").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_safetensors(tmp_path / "junk")
    odd = data.replace(b'"F32"', b'"C64"')
    (tmp_path / "odd").write_bytes(odd)
    with pytest.raises(ValueError, match="dtype 'C64'"):
        read_safetensors(tmp_path / "odd")
