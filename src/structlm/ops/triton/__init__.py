"""Triton kernel backend (imported lazily: the package works without Triton or a GPU).

Available on CUDA devices, and on the CPU under the Triton interpreter
(``TRITON_INTERPRET=1``, used by the tests).
"""

from __future__ import annotations

import os

import torch

from ..dispatch import Backend, register_backend
from .op import algebra_linear, register_tables, triton_linear
from .tables import SupportTables, build_tables

__all__ = [
    "SupportTables",
    "algebra_linear",
    "build_tables",
    "is_available",
    "register_tables",
    "triton_linear",
]


def is_available(device: torch.device) -> bool:
    """Triton runs on CUDA, or on the CPU under its interpreter."""
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


register_backend(Backend.TRITON, is_available)
