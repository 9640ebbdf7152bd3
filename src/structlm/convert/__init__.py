"""Change the product of a pretrained model: ``convert_(model, AlgebraConfig(...))``
replaces its projections by algebra layers with the same parameters; ``unconvert_``
restores the dense model. A converted model saved with ``save_pretrained`` loads back
converted — with ``load_converted``, or plain ``from_pretrained`` once structlm is
imported (:func:`~structlm.convert.record.install_from_pretrained_hook`, installed here
when ``transformers`` is present); its record is kept in ``config.json`` and in the
weights' safetensors metadata (:mod:`structlm.convert.record`)."""

import importlib.util as _importlib_util

from structlm.convert.algebra_config import AlgebraConfig
from structlm.convert.convert import check_convertible, conversion_info, convert_, unconvert_
from structlm.convert.record import (
    install_from_pretrained_hook,
    load_converted,
    restore_conversion,
    restore_record,
)
from structlm.convert.typed_linear import PositionTypes, TypedAlgebraLinear

if _importlib_util.find_spec("transformers") is not None:
    install_from_pretrained_hook()

__all__ = ["AlgebraConfig", "PositionTypes", "TypedAlgebraLinear", "check_convertible",
           "conversion_info",
           "convert_", "install_from_pretrained_hook", "load_converted",
           "restore_conversion", "restore_record", "unconvert_"]
