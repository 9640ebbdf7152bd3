"""structlm: structured weights in Transformer language models.

Public API::

    from structlm import AlgebraLinear, get_algebra, CyclicSchedule, BlockSchedule
"""

import importlib.util as _importlib_util

from structlm.algebra import Algebra, AlgebraError, get_algebra, support_of
from structlm.convert import AlgebraConfig, conversion_info, convert_, load_converted, unconvert_
from structlm.nn import AlgebraLinear, BlockSchedule, CyclicSchedule, TableSchedule, get_schedule
from structlm.ops import Backend, TypePartition, force_backend

__version__ = "0.1.0"

if _importlib_util.find_spec("transformers") is not None:
    # registers StructLM with transformers' Auto classes, so that after ``import structlm``
    # ``AutoModelForCausalLM.from_pretrained(folder)`` loads a saved StructLM model
    from structlm import models as _models  # noqa: F401

__all__ = [
    "Algebra",
    "AlgebraConfig",
    "AlgebraError",
    "AlgebraLinear",
    "Backend",
    "BlockSchedule",
    "CyclicSchedule",
    "TableSchedule",
    "TypePartition",
    "conversion_info",
    "convert_",
    "force_backend",
    "get_algebra",
    "get_schedule",
    "load_converted",
    "support_of",
    "unconvert_",
]
