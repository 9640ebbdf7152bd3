"""The allocator setting of the ``structlm`` command (:mod:`structlm.cpu_malloc`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

from structlm.bench.timing import environment
from structlm.cli import build_parser

_PROBE = r"""
import ctypes, ctypes.util, sys, torch
from structlm.cpu_malloc import malloc_setting, retain_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2

def mapped_bytes_while_holding(numel):
    base = libc.mallinfo2().hblkhd  # mappings that exist already
    t = torch.empty(numel).fill_(1.0)  # 40 MiB float32
    held = libc.mallinfo2().hblkhd - base
    del t
    return held

before = mapped_bytes_while_holding(10 * 2**20)
if sys.argv[1] == "retain":
    assert retain_freed_memory()
after = mapped_bytes_while_holding(10 * 2**20)
print(before, after, malloc_setting())
"""


def _glibc_with_mallinfo2() -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    return hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallinfo2")


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
@pytest.mark.parametrize("mode", ["retain", "system"])
def test_retained_heap_serves_large_tensors_without_mmap(mode: str) -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True,
                         text=True, check=True).stdout.split(maxsplit=2)
    before, after, setting = int(out[0]), int(out[1]), out[2].strip()
    assert before >= 40 * 2**20  # glibc's default: a 40 MiB tensor is its own mapping
    if mode == "retain":
        assert after < 2**20  # served from the heap: no fresh mapping to fault in
        assert setting.startswith("glibc ") and setting.endswith("freed memory retained")
    else:
        assert after >= 40 * 2**20
        assert setting == "system"


def test_system_malloc_flag_and_environment_record() -> None:
    args = build_parser().parse_args(["--system-malloc", "algebra", "table"])
    assert args.system_malloc is True
    assert build_parser().parse_args(["algebra", "table"]).system_malloc is False
    assert "malloc" in environment()
