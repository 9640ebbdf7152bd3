"""Building and loading the compiled CPU kernels (``csrc/``) as a torch extension.

The extension is built once on first use with :func:`torch.utils.cpp_extension.load`
(a C++ compiler is needed, about a minute on 2 cores), named by a hash of its sources,
its flags and the host CPU's instruction-set flags (``-march=native``), in
``$TORCH_EXTENSIONS_DIR/structlm/`` (by default ``~/.cache/torch_extensions/structlm/``).
Without a compiler, or with ``STRUCTLM_CPU_KERNELS=0``, :func:`extension` is ``None`` and
the pure-PyTorch paths run (a warning says why, once).
"""

from __future__ import annotations

import hashlib
import platform
import time
import warnings
from pathlib import Path
from types import ModuleType

from structlm.settings import cpu_kernels_enabled, torch_extensions_dir

__all__ = ["build_directory", "extension"]

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (_CSRC / "fused_rows.cpp", _CSRC / "decode_block.cpp", _CSRC / "decode_hf.cpp",
            _CSRC / "bindings.cpp")
_HEADERS = tuple(sorted(_CSRC.glob("*.h")))  # every header the sources include
#: -fopenmp matters: without it ATen's parallel_for runs serially inside an extension
_FLAGS = ["-O3", "-march=native", "-fopenmp"]
_STATE: dict[str, ModuleType | None] = {}
#: a build lock older than this is left over from an interrupted build
_STALE_LOCK_S = 900


def build_directory(name: str) -> Path:
    """``$TORCH_EXTENSIONS_DIR/structlm/NAME`` (default ``~/.cache/torch_extensions``),
    with a stale lock from an interrupted build removed (torch would wait on it forever)."""
    path = torch_extensions_dir() / "structlm" / name
    path.mkdir(parents=True, exist_ok=True)
    lock = path / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    return path


def _cpu_fingerprint() -> bytes:
    """The host's instruction-set flags: ``-march=native`` builds for this CPU, so a
    build folder shared with another CPU (an AVX2-only host loading an AVX-512 build)
    must not match."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.encode()
    except OSError:
        pass
    return platform.machine().encode() + platform.processor().encode()


def _build() -> ModuleType | None:
    if not cpu_kernels_enabled():
        return None
    from torch.utils import cpp_extension

    text = b"".join(p.read_bytes() for p in (*_SOURCES, *_HEADERS))
    digest = hashlib.sha1(text + " ".join(_FLAGS).encode() + _cpu_fingerprint()
                          ).hexdigest()[:10]
    name = f"structlm_fused_rows_{digest}"
    try:
        return cpp_extension.load(
            name=name, sources=[str(p) for p in _SOURCES], extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"], verbose=False,
            build_directory=str(build_directory(name)),
        )
    except Exception as exc:  # no compiler, no ninja, unsupported flags: fall back
        warnings.warn(
            f"structlm: could not build the CPU fused-rows kernel ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}); decode "
            "uses the pure-PyTorch layouts instead. Set STRUCTLM_CPU_KERNELS=0 to skip "
            "the build.",
            RuntimeWarning, stacklevel=3,
        )
        return None


def extension() -> ModuleType | None:
    """The compiled extension, built on the first call (``None`` where it cannot be
    built, with a warning saying why, or with ``STRUCTLM_CPU_KERNELS=0``)."""
    if "mod" not in _STATE:
        _STATE["mod"] = _build()
    return _STATE["mod"]
