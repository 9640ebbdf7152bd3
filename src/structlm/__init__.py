"""structlm: structured weights in Transformer language models.

Public API::

    from structlm import AlgebraLinear, get_algebra, CyclicSchedule, BlockSchedule
    from structlm import convert_, AlgebraConfig, load_converted, explain_routes

``import structlm`` registers the StructLM model with ``transformers``' Auto classes,
makes ``from_pretrained`` restore a saved converted model's conversion, and lets
``structlm.hf.load_model`` load folders written by ``structlm share compress``. It imports
neither matplotlib nor the experiments.
"""

import importlib.util as _importlib_util
from typing import Any as _Any

from structlm.algebra import Algebra, AlgebraError, get_algebra, support_of
from structlm.convert import AlgebraConfig, conversion_info, convert_, load_converted, unconvert_
from structlm.nn import (
    AlgebraLinear,
    BlockSchedule,
    CyclicSchedule,
    TableSchedule,
    get_schedule,
    invalidate_fast_paths,
)
from structlm.ops import THRESHOLDS, Backend, Route, TypePartition, force_backend

__version__ = "0.1.0"

if _importlib_util.find_spec("transformers") is not None:
    # registers StructLM with transformers' Auto classes, so that after ``import structlm``
    # ``AutoModelForCausalLM.from_pretrained(folder)`` loads a saved StructLM model
    from structlm import models as _models  # noqa: F401

    # registers the compressed-folder format with structlm.hf.load_model
    from structlm import share as _share  # noqa: F401


def explain_routes(model: _Any, batch: int = 1, tokens: int = 8,
                   decode_steps: int = 1) -> list[_Any]:
    """Which path every layer of ``model`` takes for a prefill of ``(batch, tokens)``
    and ``decode_steps`` cached decode steps (see :mod:`structlm.hf.routes`; print the
    result with :func:`structlm.hf.routes.format_routes`).

    Raises:
        TypeError: ``model`` is not a Hugging Face causal LM (a model with
            ``get_input_embeddings``), e.g. a plain ``nn.Module`` or a string.
    """
    from structlm.hf.routes import explain_routes as _explain

    return _explain(model, batch=batch, tokens=tokens, decode_steps=decode_steps)


__all__ = [
    "THRESHOLDS",
    "Algebra",
    "AlgebraConfig",
    "AlgebraError",
    "AlgebraLinear",
    "Backend",
    "BlockSchedule",
    "CyclicSchedule",
    "Route",
    "TableSchedule",
    "TypePartition",
    "conversion_info",
    "convert_",
    "explain_routes",
    "force_backend",
    "get_algebra",
    "get_schedule",
    "invalidate_fast_paths",
    "load_converted",
    "support_of",
    "unconvert_",
]
