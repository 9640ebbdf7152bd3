"""Every environment variable structlm reads, in one place, each read when it is used
(so a test or a caller can set it at any time).

=============================  ============================================================
variable                       effect
=============================  ============================================================
``STRUCTLM_CACHE``             root of structlm's caches (default ``~/.cache/structlm``):
                               converted built-in models, tokenised text, trained
                               tokenizers, calibration statistics, downloaded corpora
``STRUCTLM_BACKEND``           forces the algebra layers' ``auto`` backend (``reference``,
                               ``blocked``, ``triton``): for tests and debugging
``STRUCTLM_CPU_KERNELS``       ``0`` skips building the compiled CPU kernels (the
                               pure-PyTorch paths run instead)
``STRUCTLM_DECODE_COPY``       weight copy of single-type few-row products: ``typed``
                               (default, faster) or ``blocks`` (less memory)
``STRUCTLM_TRITON_DISPATCH``   a ``dispatch.json`` measured by ``benchmarks/gpu_kernels.py``
                               (the Triton forward mode per shape)
``TORCH_EXTENSIONS_DIR``       where the CPU kernels are built (torch's own variable;
                               default ``~/.cache/torch_extensions``)
``TRITON_INTERPRET``           ``1`` runs the Triton kernels on the CPU (Triton's own)
``WORLD_SIZE``, ``LOCAL_RANK``  set by ``torchrun``: distributed training
``OMP_WAIT_POLICY``            OpenMP's own: recorded in every benchmark's environment;
                               ``PASSIVE`` gets a warning from the benchmarks (every
                               parallel region then pays a thread wake-up)
=============================  ============================================================
"""

from __future__ import annotations

import os
from collections.abc import Container
from pathlib import Path
from typing import Any

__all__ = ["ENVIRONMENT_VARIABLES", "backend_override", "backend_override_probe",
           "backend_override_set", "cache_dir", "cpu_kernels_enabled",
           "decode_copy_default", "local_rank", "omp_wait_policy", "torch_extensions_dir",
           "triton_dispatch_path", "triton_interpret", "world_size"]

ENVIRONMENT_VARIABLES = ("STRUCTLM_CACHE", "STRUCTLM_BACKEND", "STRUCTLM_CPU_KERNELS",
                         "STRUCTLM_DECODE_COPY", "STRUCTLM_TRITON_DISPATCH",
                         "TORCH_EXTENSIONS_DIR", "TRITON_INTERPRET", "WORLD_SIZE", "LOCAL_RANK",
                         "OMP_WAIT_POLICY")
"""The variables documented above (a test checks that no other is read)."""


def cache_dir(*parts: str) -> Path:
    """``$STRUCTLM_CACHE/<parts>`` (default ``~/.cache/structlm``); not created."""
    root = os.environ.get("STRUCTLM_CACHE") or os.path.join(Path.home(), ".cache", "structlm")
    return Path(root).joinpath(*parts)


def backend_override() -> str | None:
    """``STRUCTLM_BACKEND`` if set (a backend name, validated by the caller)."""
    return os.environ.get("STRUCTLM_BACKEND") or None


#: ``STRUCTLM_BACKEND`` as ``os.environ``'s underlying dict stores it (CPython, POSIX)
_BACKEND_KEY_ENCODED: bytes | None = (
    os.environ.encodekey("STRUCTLM_BACKEND")  # type: ignore[attr-defined]
    if hasattr(os.environ, "encodekey") else None)


def backend_override_probe() -> tuple[Any, Container[Any], object]:
    """``(environ, container, key)``: while ``os.environ is environ``, ``key in container``
    is true exactly when ``STRUCTLM_BACKEND`` is set, read live (``os.environ``'s own dict
    and the encoded name where CPython has them: one dict lookup, no Python frame; the
    bound decode calls ask on every call, with cold caches). After ``os.environ`` is
    replaced (``mock.patch("os.environ", ...)``), ask :func:`backend_override_set`."""
    data = getattr(os.environ, "_data", None)
    if data is not None and _BACKEND_KEY_ENCODED is not None:
        return os.environ, data, _BACKEND_KEY_ENCODED
    return os.environ, os.environ, "STRUCTLM_BACKEND"


def backend_override_set() -> bool:
    """Whether ``STRUCTLM_BACKEND`` is set (cheaper than reading it; asked on every bound
    decode call: ``key in os.environ`` runs three Python frames and raises and catches a
    ``KeyError`` for a missing key, so the live dict is read where there is one,
    :func:`backend_override_probe`)."""
    _, container, key = backend_override_probe()
    return key in container


def cpu_kernels_enabled() -> bool:
    """False when ``STRUCTLM_CPU_KERNELS=0``."""
    return os.environ.get("STRUCTLM_CPU_KERNELS", "1") != "0"


def decode_copy_default() -> str:
    """``STRUCTLM_DECODE_COPY`` (default ``typed``; validated by the caller)."""
    return os.environ.get("STRUCTLM_DECODE_COPY", "typed")


def triton_dispatch_path() -> str | None:
    """``STRUCTLM_TRITON_DISPATCH`` if set."""
    return os.environ.get("STRUCTLM_TRITON_DISPATCH") or None


def torch_extensions_dir() -> Path:
    """``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR")
                or Path.home() / ".cache" / "torch_extensions")


def triton_interpret() -> bool:
    """Whether ``TRITON_INTERPRET=1`` (Triton kernels on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def world_size() -> int:
    """``WORLD_SIZE`` (1 without ``torchrun``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """``LOCAL_RANK`` (0 without ``torchrun``)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def omp_wait_policy() -> str:
    """``OMP_WAIT_POLICY`` as set (``"unset"`` when it is not)."""
    return os.environ.get("OMP_WAIT_POLICY", "unset")
