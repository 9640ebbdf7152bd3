"""Modules: AlgebraLinear, DecodeLinear and position-type schedules."""

from structlm.nn.algebra_linear import AlgebraLinear
from structlm.nn.decode_linear import (
    DENSE_ROWS_MAX_ROWS,
    DecodeLinear,
    dense_rows_applies,
    fast_linear,
)
from structlm.nn.schedules import (
    BlockSchedule,
    CyclicSchedule,
    TableSchedule,
    TypeSchedule,
    get_schedule,
)

__all__ = [
    "DENSE_ROWS_MAX_ROWS",
    "AlgebraLinear",
    "BlockSchedule",
    "CyclicSchedule",
    "DecodeLinear",
    "TableSchedule",
    "TypeSchedule",
    "dense_rows_applies",
    "fast_linear",
    "get_schedule",
]
