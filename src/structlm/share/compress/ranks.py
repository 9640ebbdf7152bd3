"""Ranks, stored parameters and budgets of the compression methods, by method name.

Every method's rank is bounded only by its own algebra, never by ``min(out, in)`` of a
method that does not need it (under grouped-query attention K and V are ``192 × 576`` in
SmolLM2; a shared input basis of V can hold up to 576 directions):

================== ============================================ ===========================
method             stored parameters of one type (``L`` layers)  rank bounds
================== ============================================ ===========================
``svd-llm-w``      ``L k (out + in)`` per part                  ``k ≤ min(out_p, in)``
``svd-llm``        as ``svd-llm-w`` (the update changes values)  as ``svd-llm-w``
``shared``         ``k_out·out + k_in·in + L k_out k_in``       ``k_out ≤ out``, ``k_in ≤ in``
``hybrid``         ``shared + L r (out + in)``                  as ``shared``; ``r ≤ min``
``basis-sharing``  ``Σ_groups Σ_parts k_g·in + n_g k_g out_p``  ``k_g = min(k, in, n_g out_p)``
================== ============================================ ===========================

``basis-sharing`` (Wang et al., 2024) shares one input basis within each group of ``n_g``
consecutive layers. ``svd-llm-w``, ``svd-llm`` and ``basis-sharing`` factorise a gated
MLP-in as two parts
(gate, up: ``parts = 2``, ``out_p = out / 2``), each on its own, as SVD-LLM and the Basis
Sharing code treat ``gate_proj`` and ``up_proj``; the seed's ``shared`` keeps the stacked
``[gate; up]`` as one matrix type. Basis sharing's private types (O, MLP-out by default)
are per-layer ``svd-llm-w``. ``onesided-all-layers`` is ``basis-sharing`` with one group of all
layers.

Each method's accounting and rank solver lives in its file under
:mod:`structlm.share.compress.methods`; :func:`stored_parameters` and :func:`token_macs`
look the method up in the registry :data:`METHODS` by name.

Budgets are **per type**: ``target_reduction`` removes that fraction of every compressed
type's parameters (the convention of the Basis Sharing and SVD-LLM tables), so every
method stores the same number of parameters per type up to one rank's rounding.
"""

from __future__ import annotations

from structlm.share.compress.factorize import TypeRanks
from structlm.share.compress.methods import BASIS_SHARING, METHODS, get_method
from structlm.share.compress.methods.basis_sharing import (
    consecutive_groups,
    max_basis_rank,
    solve_basis_sharing_rank,
)
from structlm.share.compress.methods.svd import solve_svd_rank

__all__ = ["BASIS_SHARING", "METHODS", "TypeRanks", "consecutive_groups", "max_basis_rank",
           "solve_basis_sharing_rank", "solve_svd_rank", "stored_parameters", "token_macs"]


def stored_parameters(method: str, out: int, inn: int, ranks: TypeRanks,
                      group_sizes: list[int], parts: int = 1) -> int:
    """Stored parameters of one type under the registered ``method`` (biases unchanged,
    not counted).

    ``group_sizes``: layers per group (``[1] * L`` for per-layer methods; only methods
    that share within groups read the grouping); ``parts``: row blocks factorised
    separately (2 for a gated MLP-in under ``svd-llm-w``/``svd-llm``/``basis-sharing``)."""
    return get_method(method).stored_parameters(out, inn, ranks, group_sizes, parts)


def token_macs(method: str, out: int, inn: int, ranks: TypeRanks, group_sizes: list[int],
               parts: int = 1) -> int:
    """Multiply-adds per token of one type summed over its ``L`` layers, in the order the
    modules take for one row (``P x`` first; a shared basis's ``U A`` is not formed):

    ``svd-llm-w``/``svd-llm`` ``parts·k (out_p + in)`` a layer (= its stored parameters); ``shared``
    ``k_in·in + k_out·k_in + out·k_out`` (``hybrid`` ``+ r (out + in)``); ``basis-sharing``
    ``parts·k_g (in + out_p)``, since every layer maps its own input onto the group's
    basis. Unlike the stored parameters, a shared basis costs MACs in every layer: a
    two-sided ``shared`` type can cost more per token than the dense matrix."""
    return get_method(method).token_macs(out, inn, ranks, group_sizes, parts)
