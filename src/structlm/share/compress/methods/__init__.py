"""Compression methods, one file each behind :class:`~.base.CompressionMethod`, and their
registry :data:`~.base.METHODS`.

A new method is one module here that subclasses :class:`CompressionMethod` and calls
:func:`register` on an instance, imported below (or registered from anywhere before the
``CompressionConfig`` that names it is made). The built-in modules are imported in the
order of :data:`METHODS` (the order of the experiment's default method list).
"""

# isort: off
from structlm.share.compress.methods.base import (
    METHODS,
    CompressionMethod,
    LayoutOptions,
    TypePlan,
    get_method,
    register,
)
from structlm.share.compress.methods.shared import HYBRID_METHOD, SHARED_METHOD
from structlm.share.compress.methods.svd import SVD_METHOD
from structlm.share.compress.methods.basis_sharing import (
    BASIS_SHARING,
    BASIS_SHARING_METHOD,
    ONESIDED_ALL_LAYERS_METHOD,
)
# isort: on

__all__ = ["BASIS_SHARING", "BASIS_SHARING_METHOD", "HYBRID_METHOD", "METHODS",
           "ONESIDED_ALL_LAYERS_METHOD", "SHARED_METHOD", "SVD_METHOD", "CompressionMethod",
           "LayoutOptions", "TypePlan", "get_method", "register"]
