"""Change the product of a pretrained model: ``convert_(model, AlgebraConfig(...))``
replaces its projections by algebra layers with the same parameters; ``unconvert_``
restores the dense model; ``load_converted`` reloads a saved converted model."""

from structlm.convert.convert import (
           AlgebraConfig,
           conversion_info,
           convert_,
           load_converted,
           unconvert_,
)
from structlm.convert.typed_linear import PositionTypes, TypedAlgebraLinear

__all__ = ["AlgebraConfig", "PositionTypes", "TypedAlgebraLinear", "conversion_info",
           "convert_", "load_converted", "unconvert_"]
