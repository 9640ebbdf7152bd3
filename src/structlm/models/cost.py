"""MAC and parameter accounting of a model config, dense vs its algebra (SPEC §A.3–A.4).

Counts are per token, multiply–accumulates of matrix products only (no norms,
activations, softmax or optimiser). Attention scores at training time use the mean
causal length ``(T + 1) / 2`` of a full context ``T``; decode uses a full context.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from ..algebra.cost import algebra_rho, decode_macs, decode_projection_ratio
from .configuration_structlm import StructLMConfig

__all__ = ["model_cost", "parameter_count"]


def parameter_count(cfg: StructLMConfig) -> int:
    """Trainable parameters (tied head counted once); the algebra keeps them all."""
    d, f, v, t, n = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.n_positions,
                     cfg.num_hidden_layers)
    per_layer = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 3 * d * f
    head = 0 if cfg.tie_word_embeddings else d * v
    return v * d + t * d + n * per_layer + 2 * d + head


def _rho(cfg: StructLMConfig) -> Fraction:
    if cfg.algebra.strip().lower() in ("dense", "q1"):
        return Fraction(1)
    return algebra_rho(cfg.algebra)


def model_cost(cfg: StructLMConfig) -> dict[str, Any]:
    """Parameters, decode MACs per token and training MACs per token by component."""
    d, f, v, t, n = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.n_positions,
                     cfg.num_hidden_layers)
    rho = _rho(cfg)
    dec = {name: n * decode_macs(d, d, d, f, t, r) + d * v
           for name, r in (("dense", Fraction(1)), ("algebra", rho))}
    mean_len = Fraction(t + 1, 2)
    fwd = {
        "attention_projections": (n * 4 * d * d, n * 4 * d * d),
        "attention_scores": (n * 2 * d * mean_len, n * 2 * d * mean_len),
        "ffn": (n * 3 * d * f, n * 3 * d * f * rho),
        "lm_head": (d * v, d * v),
    }
    train = {k: {"dense": 3 * a, "algebra": 3 * b} for k, (a, b) in fwd.items()}
    train["total"] = {side: sum(c[side] for c in train.values()) for side in ("dense", "algebra")}
    return {
        "preset_algebra": cfg.algebra,
        "parameters": parameter_count(cfg),
        "rho_ffn": str(rho),
        "projection_mac_ratio": str(decode_projection_ratio(d, d, d, f, rho)),
        "decode_macs_per_token": {k: int(val) for k, val in dec.items()},
        "decode_ratio": str(Fraction(dec["algebra"]) / dec["dense"]),
        "training_macs_per_token": {k: {s: round(x) for s, x in vals.items()}
                                    for k, vals in train.items()},
        "training_ratio": str(Fraction(train["total"]["algebra"]) / train["total"]["dense"]),
    }
