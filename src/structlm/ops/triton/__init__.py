"""Triton kernel backend (imported lazily: the package works without Triton or a GPU).

Available on CUDA devices, and on the CPU under the Triton interpreter
(``TRITON_INTERPRET=1``, used by the tests).
"""

from __future__ import annotations

import torch

from structlm.ops.dispatch import Backend, register_backend
from structlm.ops.triton.op import algebra_linear, register_tables, triton_linear
from structlm.ops.triton.tables import SupportTables, build_tables
from structlm.settings import triton_interpret

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
    return device.type == "cpu" and triton_interpret()


register_backend(Backend.TRITON, is_available)
