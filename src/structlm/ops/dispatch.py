"""Backend selection for :class:`~structlm.nn.AlgebraLinear`.

``Backend.AUTO`` picks the fastest available implementation for the device:
a registered GPU kernel backend (the ``triton`` slot, filled by a later module)
on CUDA when it is importable, else ``blocked``.  ``Backend.REFERENCE`` is the
slow oracle.  ``STRUCTLM_BACKEND=<name>`` in the environment (or
:func:`force_backend`) overrides AUTO, for tests and debugging.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
from collections.abc import Callable, Iterator

import torch

from structlm.settings import backend_override

__all__ = [
    "Backend",
    "auto_overridden",
    "available_backends",
    "force_backend",
    "parse_backend",
    "register_backend",
    "resolve_backend",
]


class Backend(enum.StrEnum):
    """Implementation of the algebra product."""

    AUTO = "auto"
    REFERENCE = "reference"
    BLOCKED = "blocked"
    TRITON = "triton"


# name -> probe returning True when the backend can run on the given device
_AVAILABLE: dict[Backend, Callable[[torch.device], bool]] = {
    Backend.REFERENCE: lambda device: True,
    Backend.BLOCKED: lambda device: True,
}
_FORCED: list[Backend] = []


def register_backend(backend: Backend, is_available: Callable[[torch.device], bool]) -> None:
    """Register a backend (e.g. the Triton kernels) with an availability probe."""
    _AVAILABLE[backend] = is_available


def available_backends(device: torch.device) -> list[Backend]:
    """Backends that can run on ``device``."""
    return [b for b, ok in _AVAILABLE.items() if ok(device)]


def parse_backend(name: str | Backend) -> Backend:
    """A :class:`Backend` from its name, with a clear error for an unknown one."""
    try:
        return Backend(name.value if isinstance(name, Backend) else str(name).lower())
    except ValueError:
        choices = ", ".join(b.value for b in Backend)
        raise ValueError(f"unknown backend {name!r}: expected one of {choices}") from None


_TRITON_IMPORT_TRIED: list[bool] = []


def _try_import_triton_backend() -> None:
    """Import (and so register) the Triton backend once, if Triton is installed."""
    if _TRITON_IMPORT_TRIED:
        return
    _TRITON_IMPORT_TRIED.append(True)
    try:
        importlib.import_module("structlm.ops.triton")
    except ImportError:
        pass


def resolve_backend(requested: str | Backend, device: torch.device,
                    dtype: torch.dtype | None = None) -> Backend:
    """The concrete backend to run for ``requested`` on ``device``."""
    req = requested if isinstance(requested, Backend) else parse_backend(requested)
    if req is Backend.BLOCKED or req is Backend.REFERENCE:
        return req  # always available
    if req is Backend.AUTO:
        if _FORCED:
            req = _FORCED[-1]
        elif backend_override():
            req = parse_backend(backend_override())
    if req is Backend.AUTO:
        if device.type == "cuda" and dtype != torch.float64:
            _try_import_triton_backend()
            if Backend.TRITON in available_backends(device):
                return Backend.TRITON
        return Backend.BLOCKED
    if req is Backend.TRITON:
        _try_import_triton_backend()
    if req not in _AVAILABLE or not _AVAILABLE[req](device):
        raise RuntimeError(
            f"backend {req.value!r} is not available on device {device}; available: "
            f"{[b.value for b in available_backends(device)]}"
        )
    return req


def auto_overridden() -> bool:
    """Whether ``Backend.AUTO`` is overridden now (:func:`force_backend` or
    ``STRUCTLM_BACKEND``): the layers' bound decode calls then take the general path."""
    return bool(_FORCED) or backend_override() is not None


@contextlib.contextmanager
def force_backend(name: str | Backend) -> Iterator[None]:
    """Within the block, layers built with ``backend="auto"`` use ``name``."""
    _FORCED.append(parse_backend(name))
    try:
        yield
    finally:
        _FORCED.pop()
