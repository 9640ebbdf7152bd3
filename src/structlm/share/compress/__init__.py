"""Compression with shared bases (tests 4–9): methods, modules, accounting, save/load."""

from structlm.nn.factorized import LowRankLinear, OneSidedLinear, SharedBasis, SharedBasisLinear
from structlm.share.compress.apply import (
    CompressionConfig,
    TypePlan,
    build_modules,
    compress_model,
    plan_types,
)
from structlm.share.compress.basis_sharing import factorize_basis_sharing, update_coefficients
from structlm.share.compress.factorize import (
    TypeFactors,
    best_rectangular_ranks,
    factorize_shared,
    factorize_svd,
)
from structlm.share.compress.io import load_compressed, save_compressed
from structlm.share.compress.ranks import (
    BASIS_SHARING,
    METHODS,
    TypeRanks,
    consecutive_groups,
    solve_basis_sharing_rank,
    solve_svd_rank,
    stored_parameters,
    token_macs,
)

__all__ = ["BASIS_SHARING", "METHODS", "CompressionConfig", "LowRankLinear", "OneSidedLinear",
           "SharedBasis", "SharedBasisLinear", "TypeFactors", "TypePlan", "TypeRanks",
           "best_rectangular_ranks", "build_modules", "compress_model", "consecutive_groups",
           "factorize_basis_sharing", "factorize_shared", "factorize_svd", "load_compressed",
           "plan_types", "save_compressed", "solve_basis_sharing_rank", "solve_svd_rank",
           "stored_parameters", "token_macs", "update_coefficients"]
