"""Modules: AlgebraLinear and position-type schedules."""

from .algebra_linear import AlgebraLinear
from .schedules import BlockSchedule, CyclicSchedule, TableSchedule, TypeSchedule, get_schedule

__all__ = [
    "AlgebraLinear",
    "BlockSchedule",
    "CyclicSchedule",
    "TableSchedule",
    "TypeSchedule",
    "get_schedule",
]
