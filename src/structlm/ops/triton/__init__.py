"""Triton kernel backend (imported lazily: the package works without Triton or a GPU).

Available on CUDA devices, and on the CPU under the Triton interpreter
(``TRITON_INTERPRET=1``, used by the tests): :func:`structlm.ops.route.resolve_backend`
decides, and the route picks the forward mode.
"""

from __future__ import annotations

from structlm.ops.triton.op import algebra_linear, register_tables, triton_linear
from structlm.ops.triton.tables import SupportTables, build_tables

__all__ = [
    "SupportTables",
    "algebra_linear",
    "build_tables",
    "register_tables",
    "triton_linear",
]
