"""Compression with shared bases (tests 4–9): methods, modules, accounting, save/load."""

from .apply import CompressionConfig, build_modules, compress_model, solve_ranks
from .factorize import METHODS, TypeFactors, factorize_type, rank_for_budget, stored_parameters
from .io import load_compressed, save_compressed
from .modules import LowRankLinear, OneSidedLinear, SharedBasis, SharedBasisLinear

__all__ = ["METHODS", "CompressionConfig", "LowRankLinear", "OneSidedLinear", "SharedBasis",
           "SharedBasisLinear", "TypeFactors", "build_modules", "compress_model",
           "factorize_type", "load_compressed", "rank_for_budget", "save_compressed",
           "solve_ranks", "stored_parameters"]
