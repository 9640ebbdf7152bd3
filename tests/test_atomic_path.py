"""``atomic_path``: the destination appears whole or not at all."""

from __future__ import annotations

import pytest

from structlm.atomic import atomic_path


def test_the_file_appears_only_when_the_block_succeeds(tmp_path) -> None:
    dest = tmp_path / "sub" / "out.bin"
    with atomic_path(dest, ".bin") as tmp:
        assert tmp.parent == dest.parent and tmp.suffix == ".bin" and not dest.exists()
        tmp.write_bytes(b"payload")
    assert dest.read_bytes() == b"payload"
    assert [p.name for p in dest.parent.iterdir()] == ["out.bin"]


def test_a_failed_block_leaves_neither_file_nor_temporary(tmp_path) -> None:
    dest = tmp_path / "out.bin"
    dest.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with atomic_path(dest) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("writer failed")
    assert dest.read_bytes() == b"old"  # the previous file is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]
