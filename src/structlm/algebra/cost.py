"""Exact cost accounting (SPEC §A.2–A.5), in exact fractions where the seed has them.

All counts are multiply–accumulates (MACs) of the projections only: no optimiser,
normalisation, activation or data movement.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from structlm.algebra.catalogue import get_algebra
from structlm.algebra.structure import AlgebraError
from structlm.algebra.support import LayerSupport, support_of

__all__ = [
    "algebra_rho",
    "attention_score_ratio",
    "attention_speedup_bounds",
    "block_rank_lower_bound",
    "decode_macs",
    "decode_projection_ratio",
    "fixed_leaf_square_cost",
    "projection_forward_macs",
    "projection_training_macs",
    "rho_q",
    "screening_max_q",
    "square_cost",
    "swiglu_macs",
]


def rho_q(q: int) -> Fraction:
    """Equal-width MAC ratio of ``Q_q``: ``(2q - 1) / q^2``."""
    if q < 1:
        raise AlgebraError(f"q must be >= 1, got {q}")
    return Fraction(2 * q - 1, q * q)


def _support(algebra: str | LayerSupport) -> LayerSupport:
    return algebra if isinstance(algebra, LayerSupport) else support_of(get_algebra(algebra))


def algebra_rho(
    algebra: str | LayerSupport,
    in_widths: Sequence[int] | None = None,
    out_widths: Sequence[int] | None = None,
    type_counts: Sequence[int] | None = None,
) -> Fraction:
    """``rho`` of an algebra's layer for the given widths and type mix (defaults:
    equal widths, uniform mix)."""
    return _support(algebra).mac_ratio(in_widths, out_widths, type_counts)


def projection_forward_macs(
    algebra: str | LayerSupport,
    type_counts: Sequence[int],
    in_widths: Sequence[int],
    out_widths: Sequence[int],
) -> int:
    """``C_proj_fwd = M D_diag + sum_i M_i s_i (N - r_i)`` (general support form)."""
    return _support(algebra).macs(type_counts, in_widths, out_widths)


def projection_training_macs(
    algebra: str | LayerSupport,
    type_counts: Sequence[int],
    in_widths: Sequence[int],
    out_widths: Sequence[int],
) -> int:
    """Forward + ``dX`` + ``dW``: each repeats the forward support, so ``3 C_fwd``."""
    return 3 * projection_forward_macs(algebra, type_counts, in_widths, out_widths)


def swiglu_macs(tokens: int, d_model: int, d_ff: int, rho: Fraction | int = 1,
                training: bool = True) -> Fraction:
    """SwiGLU (gate, up, down): ``3 rho B D F`` forward, ``9 rho B D F`` training."""
    return Fraction(rho) * (9 if training else 3) * tokens * d_model * d_ff


def decode_macs(d_model: int, h_q: int, h_kv: int, d_ff: int, context: int,
                rho: Fraction | int = 1, gates: int = 2) -> Fraction:
    """Per-layer MACs of one decoded token (SPEC §A.4):
    ``C_dec = 2 D H_q + 2 D H_kv + rho (g+1) D F + 2 N H_q``."""
    return (2 * d_model * h_q + 2 * d_model * h_kv
            + Fraction(rho) * (gates + 1) * d_model * d_ff + 2 * context * h_q)


def decode_projection_ratio(d_model: int, h_q: int, h_kv: int, d_ff: int,
                            rho: Fraction | int, gates: int = 2) -> Fraction:
    """Projection MACs of a decode step, algebra over dense (59/80 for the paper's
    LM: ``H_q = H_kv = D``, ``F = 2D``, ``rho = 9/16``)."""
    alg = decode_macs(d_model, h_q, h_kv, d_ff, 0, rho, gates)
    dense = decode_macs(d_model, h_q, h_kv, d_ff, 0, 1, gates)
    return alg / dense


def attention_score_ratio(pairs: int, same_type_pairs: int, q: int) -> Fraction:
    """``rho_score = (2M - M_=) / (q M)`` for ``M`` allowed query–key pairs."""
    if pairs <= 0 or not 0 <= same_type_pairs <= pairs:
        raise AlgebraError(f"need 0 <= same_type_pairs <= pairs and pairs > 0, got "
                           f"{same_type_pairs}, {pairs}")
    return Fraction(2 * pairs - same_type_pairs, q * pairs)


def attention_speedup_bounds(rho_score: Fraction) -> tuple[Fraction, Fraction]:
    """Upper bounds on attention speed-up: forward ``2 / (1 + rho)``, training
    (scores recomputed in backward) ``7 / (3 + 4 rho)``."""
    rho = Fraction(rho_score)
    return Fraction(2) / (1 + rho), Fraction(7) / (3 + 4 * rho)


def square_cost(n: int, q: int) -> Fraction:
    """``C(n, q) = (2q^2 - q)(n/q)^3 = (2/q - 1/q^2) n^3`` for ``Q_q`` on ``n × n``."""
    return (2 * q * q - q) * Fraction(n, q) ** 3


def fixed_leaf_square_cost(n: int, leaf: int) -> Fraction:
    """``C(n, n/b) = 2 b n^2 - b^2 n``: quadratic in ``n`` at fixed leaf size ``b``."""
    if n % leaf:
        raise AlgebraError(f"n={n} is not a multiple of the leaf size b={leaf}")
    return square_cost(n, n // leaf)


def block_rank_lower_bound(q: int, leaf: int) -> int:
    """Block-valued bound ``R(Q_q ⊗ M_b) >= 2 n^2 - q`` with ``n = q b``."""
    n = q * leaf
    return 2 * n * n - q


def screening_max_q(m: int, k: int, n: int, m0: int, k0: int, n0: int) -> int:
    """Screening rule ``q <= min(M/m0, K/k0, N/n0)`` (a first filter, not a verdict)."""
    return min(m // m0, k // k0, n // n0)
