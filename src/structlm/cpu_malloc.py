"""Keep freed heap memory in the process, so large CPU tensors reuse warm pages.

PyTorch's CPU allocator asks the C library for every tensor and gives it back when the
tensor dies. With glibc's defaults a block of 32 MiB or more (a ``2048 x 4096`` float32
activation) is a fresh ``mmap`` each time: the kernel zero-fills and maps every page on
first touch, and ``munmap`` returns it on free. Measured on this project's 2-core VM, that
costs ~15 ms per 32 MiB output (``torch.empty(2048, 4096).fill_(1)``: 14.8 ms, 1.9 ms with
the setting below), a fixed cost per output element that structured layers do not shrink:
it was a fifth of a ``Q32`` layer's forward time at ``M = 2048`` (70 ms -> 57 ms).

:func:`retain_freed_memory` sets glibc malloc to serve every request from its heap
(``M_MMAP_MAX = 0``) and never hand freed memory back (``M_TRIM_THRESHOLD`` at its
maximum), the effect PyTorch's CPU performance guide gets by preloading jemalloc or
tcmalloc. The resident set then stays at its high-water mark — as with any caching
allocator. glibc still falls back to ``mmap`` where its heap cannot grow, so no request
fails that would otherwise succeed.

Code that frees large buffers on purpose to bound its peak — layer streaming, which
reads one layer, drops it and reads the next — runs under :func:`returning_freed_memory`
(large buffers mapped on their own again and unmapped when freed) and calls
:func:`release_freed_memory` after each layer. Measured on one 1.5B layer's ``svd-llm-w``
factorisation (8,960-wide whitening roots): 4.9 GB peak with the heap retained, 3.8 GB
with buffers returned — a retained heap cannot always fit the next large buffer into the
holes the previous ones left.

The ``structlm`` command calls it at start-up (``structlm --system-malloc ...`` does not);
a library user calls it once, early, if they want it. Benchmarks record the setting in
their environment line, and both arms of every comparison run under the same one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["malloc_setting", "release_freed_memory", "retain_freed_memory",
           "returning_freed_memory"]

#: ``mallopt`` parameters (glibc ``malloc.h``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
#: glibc's own defaults for the two (``M_MMAP_THRESHOLD`` stays at its 128 KiB default).
_MMAP_MAX_DEFAULT = 65536
_TRIM_DEFAULT = 128 * 1024
#: The largest trim threshold mallopt accepts (an ``int``).
_TRIM_NEVER = 2**31 - 1

_state: list[str] = ["system"]
_returning: list[int] = [0]


def _mallopt() -> tuple[Any, Any] | None:
    """glibc's ``mallopt`` and ``gnu_get_libc_version``, or ``None`` (not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        gnu_version = libc.gnu_get_libc_version  # present only in glibc
    except (OSError, AttributeError):
        return None
    gnu_version.restype = ctypes.c_char_p
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt, gnu_version


def retain_freed_memory() -> bool:
    """Make glibc malloc keep freed memory for reuse (see the module docstring).

    Returns:
        ``True`` when applied; ``False`` where the C library is not glibc (or has no
        ``mallopt``), in which case nothing changes.
    """
    found = _mallopt()
    if found is None:
        return False
    mallopt, gnu_version = found
    ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_NEVER) == 1
    if ok:
        _state[0] = f"glibc {gnu_version().decode()}: freed memory retained"
    return ok


def malloc_setting() -> str:
    """How this process's C allocator is set: ``"system"`` (untouched) or what
    :func:`retain_freed_memory` applied (recorded in benchmark environments)."""
    return _state[0]


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the system now (glibc ``malloc_trim(0)``), for
    code that bounds its peak by freeing large buffers while memory is retained.

    Returns:
        ``True`` when glibc released something; ``False`` otherwise (nothing to release,
        or not glibc).
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim(0) == 1


@contextmanager
def returning_freed_memory() -> Iterator[None]:
    """Within the block, undo :func:`retain_freed_memory` (large buffers are mapped on
    their own and handed back when freed); on exit, retain again if it was retained and
    release what the block freed. For code whose peak memory is its promise (layer
    streaming); does nothing where the heap was never retained."""
    found = _mallopt()
    retained = found is not None and _state[0] != "system" and not _returning[0]
    _returning[0] += 1  # nested blocks: the outermost one switches
    if retained:
        assert found is not None
        mallopt = found[0]
        mallopt(_M_MMAP_MAX, _MMAP_MAX_DEFAULT)
        mallopt(_M_TRIM_THRESHOLD, _TRIM_DEFAULT)
        release_freed_memory()
    try:
        yield
    finally:
        _returning[0] -= 1
        if retained:
            retain_freed_memory()
        release_freed_memory()
