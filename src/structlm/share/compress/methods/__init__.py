"""Compression methods, one file each behind :class:`~.base.CompressionMethod`, and their
registry :data:`~.base.METHODS`.

A new method is one module here that subclasses :class:`CompressionMethod` and calls
:func:`register` on an instance, imported below (or registered from anywhere before the
``CompressionConfig`` that names it is made). The built-in modules are imported in the
order of :data:`METHODS` (the order of the experiment's default method list).
"""

# isort: off
from structlm.share.compress.methods.base import (
    ALIASES,
    METHODS,
    CompressionMethod,
    LayoutOptions,
    TypePlan,
    canonical_name,
    get_method,
    register,
)
from structlm.share.compress.methods.shared import HYBRID_METHOD, SHARED_METHOD, HybridOptions
from structlm.share.compress.methods.svd import SVD_LLM_W_METHOD, SVD_METHOD
from structlm.share.compress.methods.svd_llm import SVD_LLM_METHOD
from structlm.share.compress.methods.basis_sharing import (
    BASIS_SHARING,
    BASIS_SHARING_METHOD,
    ONESIDED_ALL_LAYERS_METHOD,
    BasisSharingOptions,
)
from structlm.share.compress.methods.lowrank_starts import (
    CONTROL_METHODS,
    LOWRANK_RANDOM_METHOD,
    LOWRANK_SVD_METHOD,
)
# isort: on

__all__ = [
    "ALIASES",
    "BASIS_SHARING",
    "BASIS_SHARING_METHOD",
    "CONTROL_METHODS",
    "HYBRID_METHOD",
    "LOWRANK_RANDOM_METHOD",
    "LOWRANK_SVD_METHOD",
    "METHODS",
    "ONESIDED_ALL_LAYERS_METHOD",
    "SHARED_METHOD",
    "SVD_LLM_METHOD",
    "SVD_LLM_W_METHOD",
    "SVD_METHOD",
    "BasisSharingOptions",
    "CompressionMethod",
    "HybridOptions",
    "LayoutOptions",
    "TypePlan",
    "canonical_name",
    "get_method",
    "register",
]
