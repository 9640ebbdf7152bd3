"""The allocator setting of the ``structlm`` command (:mod:`structlm.cpu_malloc`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

from structlm.bench.timing import environment
from structlm.cli import build_parser

_MAPPED = r"""
import ctypes, ctypes.util, sys, torch
from structlm.cpu_malloc import malloc_setting, retain_freed_memory, returning_freed_memory

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
"""
"""A probe's start: the bytes glibc maps on their own while a tensor is held."""

_PROBE = _MAPPED + r"""
before, setting_before = mapped_bytes_while_holding(10 * 2**20), malloc_setting()
again = mapped_bytes_while_holding(10 * 2**20)  # glibc's default, a second time
assert retain_freed_memory()
after = mapped_bytes_while_holding(10 * 2**20)
print(before, again, after, setting_before, "|", malloc_setting())
"""


def _glibc_with_mallinfo2() -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    return hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallinfo2")


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_retained_heap_serves_large_tensors_without_mmap() -> None:
    """One fresh process: glibc's default maps a 40 MiB tensor afresh every time (twice, so
    the first is not a fluke); after ``retain_freed_memory`` it comes from the heap."""
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True).stdout
    numbers, settings = out.split(maxsplit=3), out.split("|")
    before, again, after = (int(v) for v in numbers[:3])
    assert before >= 40 * 2**20 and again >= 40 * 2**20  # the default: its own mapping
    assert settings[0].split(maxsplit=3)[3].strip() == "system"
    assert after < 2**20  # served from the heap: no fresh mapping to fault in
    setting = settings[1].strip()
    assert setting.startswith("glibc ") and setting.endswith("freed memory retained")


def test_system_malloc_flag_and_environment_record() -> None:
    args = build_parser().parse_args(["--system-malloc", "algebra", "table"])
    assert args.system_malloc is True
    assert build_parser().parse_args(["algebra", "table"]).system_malloc is False
    assert "malloc" in environment()


_RELEASE_PROBE = r"""
import torch
from structlm.cpu_malloc import release_freed_memory, retain_freed_memory

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

assert retain_freed_memory()
base = rss_mib()
blocks = [torch.empty(2**20).fill_(float(i + 1)) for i in range(64)]  # 64 x 4 MiB
held = rss_mib()
del blocks
kept = rss_mib()  # retained: still resident
released = release_freed_memory()
print(round(held - base), round(kept - base), round(rss_mib() - base), released)
"""


@pytest.mark.skipif(ctypes.util.find_library("c") is None or not hasattr(
    ctypes.CDLL(ctypes.util.find_library("c")), "gnu_get_libc_version"), reason="glibc only")
def test_release_hands_retained_memory_back() -> None:
    """With freed memory retained, 256 MiB freed stays resident until
    ``release_freed_memory`` (what layer streaming calls after each layer) returns it."""
    out = subprocess.run([sys.executable, "-c", _RELEASE_PROBE], capture_output=True,
                         text=True, check=True).stdout.split()
    held, kept, after, released = int(out[0]), int(out[1]), int(out[2]), out[3]
    assert held >= 250 and kept >= 250  # written, then kept by the retaining heap
    assert after <= 32 and released == "True"


_RETURNING_PROBE = _MAPPED + r"""
mapped = mapped_bytes_while_holding
assert retain_freed_memory()
before = mapped(10 * 2**20)
with returning_freed_memory():
    with returning_freed_memory():  # nested: the inner exit leaves the outer block on
        inner = mapped(10 * 2**20)
    outer = mapped(10 * 2**20)
after = mapped(10 * 2**20)
print(before, inner, outer, after, "|", malloc_setting())
"""


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_returning_freed_memory_undoes_retention_inside_the_block() -> None:
    """Inside ``returning_freed_memory`` (nested too) a 40 MiB tensor has its own mapping
    again (handed back when freed); after the block the heap retains again."""
    out = subprocess.run([sys.executable, "-c", _RETURNING_PROBE], capture_output=True,
                         text=True, check=True).stdout
    numbers, setting = out.split("|")
    before, inner, outer, after = (int(v) for v in numbers.split())
    assert before < 2**20 and after < 2**20  # retained: from the heap
    assert inner >= 40 * 2**20 and outer >= 40 * 2**20  # returned: mapped on its own
    assert setting.strip().endswith("freed memory retained")
