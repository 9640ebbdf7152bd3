"""Pure algebra: structure tensors, the catalogue, layer supports and exact costs.

Importable without ``torch``.
"""

from structlm.algebra.catalogue import (
    CATALOGUE_NAMES,
    complete_graph_algebra,
    get_algebra,
    graph_algebra,
    is_dense,
    num_types,
    tensor_power,
    tensor_product,
)
from structlm.algebra.structure import Algebra, AlgebraError, RankFacts
from structlm.algebra.support import LayerSupport, split_widths, support_of

__all__ = [
    "CATALOGUE_NAMES",
    "Algebra",
    "AlgebraError",
    "LayerSupport",
    "RankFacts",
    "complete_graph_algebra",
    "get_algebra",
    "graph_algebra",
    "is_dense",
    "num_types",
    "split_widths",
    "support_of",
    "tensor_power",
    "tensor_product",
]
