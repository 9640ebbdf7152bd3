"""structlm: structured weights in Transformer language models.

Public API::

    from structlm import AlgebraLinear, get_algebra, CyclicSchedule, BlockSchedule
"""

from .algebra import Algebra, AlgebraError, get_algebra, support_of
from .nn import AlgebraLinear, BlockSchedule, CyclicSchedule, TableSchedule, get_schedule
from .ops import Backend, TypePartition, force_backend

__version__ = "0.1.0"

__all__ = [
    "Algebra",
    "AlgebraError",
    "AlgebraLinear",
    "Backend",
    "BlockSchedule",
    "CyclicSchedule",
    "TableSchedule",
    "TypePartition",
    "force_backend",
    "get_algebra",
    "get_schedule",
    "support_of",
]
