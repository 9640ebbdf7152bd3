"""Modules: AlgebraLinear, DecodeLinear, factorised linear layers, position-type
schedules; the fused SwiGLU / decoder-stack calls (``fused``) and the structure epoch of
cached fast-path decisions (``structure``)."""

from structlm.nn.algebra_linear import AlgebraLinear
from structlm.nn.decode_linear import DecodeLinear, fast_linear
from structlm.nn.schedules import (
    BlockSchedule,
    CyclicSchedule,
    TableSchedule,
    TypeSchedule,
    get_schedule,
)
from structlm.nn.structure import StructureTracked, invalidate_fast_paths, structure_epoch

__all__ = [
    "AlgebraLinear",
    "BlockSchedule",
    "CyclicSchedule",
    "DecodeLinear",
    "StructureTracked",
    "TableSchedule",
    "TypeSchedule",
    "fast_linear",
    "get_schedule",
    "invalidate_fast_paths",
    "structure_epoch",
]
