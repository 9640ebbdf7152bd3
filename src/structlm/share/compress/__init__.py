"""Compression with shared bases (tests 4–9): methods (a registry, one file each under
:mod:`.methods`), modules, accounting, save/load."""

from structlm.nn.factorized import LowRankLinear, OneSidedLinear, SharedBasis, SharedBasisLinear
from structlm.share.compress.api import compress_
from structlm.share.compress.apply import (
    CompressionConfig,
    build_modules,
    compress_model,
    plan_types,
)
from structlm.share.compress.factorize import TypeFactors, TypeRanks
from structlm.share.compress.io import load_compressed, save_compressed
from structlm.share.compress.methods import (
    BASIS_SHARING,
    METHODS,
    BasisSharingOptions,
    CompressionMethod,
    HybridOptions,
    TypePlan,
    get_method,
)
from structlm.share.compress.methods import register as register_method
from structlm.share.compress.methods.basis_sharing import (
    consecutive_groups,
    factorize_basis_sharing,
    solve_basis_sharing_rank,
    update_coefficients,
)
from structlm.share.compress.methods.shared import best_rectangular_ranks, factorize_shared
from structlm.share.compress.methods.svd import factorize_svd, solve_svd_rank
from structlm.share.compress.ranks import stored_parameters, token_macs

__all__ = ["BASIS_SHARING", "METHODS", "BasisSharingOptions", "CompressionConfig",
           "CompressionMethod", "HybridOptions", "LowRankLinear", "OneSidedLinear",
           "SharedBasis", "SharedBasisLinear",
           "TypeFactors", "TypePlan", "TypeRanks", "best_rectangular_ranks", "build_modules",
           "compress_", "compress_model", "consecutive_groups", "factorize_basis_sharing",
           "factorize_shared", "factorize_svd", "get_method", "load_compressed", "plan_types",
           "register_method", "save_compressed", "solve_basis_sharing_rank", "solve_svd_rank",
           "stored_parameters", "token_macs", "update_coefficients"]
