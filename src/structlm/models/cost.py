"""MAC and parameter accounting of a model config, dense vs its algebra (SPEC §A.3–A.4).

Counts are per token, multiply–accumulates of matrix products only (no norms,
activations, softmax or optimiser). Attention scores at training time use the mean
causal length ``(T + 1) / 2`` of a full context ``T``; decode uses a full context.
With ``structured_scores`` the ``QK^T`` half of the attention MACs is scaled by
``rho_score`` of a full causal context under the model's schedule (averaged over
layers for a cross-layer schedule); ``PV`` stays dense.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from structlm.algebra.cost import (
    algebra_rho,
    attention_speedup_bounds,
    decode_macs,
    decode_projection_ratio,
)
from structlm.models.configuration_structlm import StructLMConfig

__all__ = ["model_cost", "parameter_count", "score_cost"]


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


def score_cost(cfg: StructLMConfig, context: int | None = None) -> dict[str, str] | None:
    """Structured-score accounting of an algebra config (whether or not the option is
    on): ``rho_score`` over the causal pairs of ``context`` positions (default: the full
    context) under the config's schedule, the long balanced limit (mean ``|F(i, j)| / q``
    over uniform types), and the seed's speed-up bounds of attention for each. ``None``
    for a dense config."""
    if cfg.algebra.strip().lower() in ("dense", "q1"):
        return None
    import torch

    from structlm.algebra import get_algebra, support_of
    from structlm.nn import get_schedule
    from structlm.nn.structured_scores import score_groups, structured_rho

    groups = score_groups(support_of(get_algebra(cfg.algebra)).mask)
    q = groups.shape[0]
    n = context or cfg.n_positions
    pos = torch.arange(n)[None]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None]
    schedule = get_schedule(cfg.type_schedule, q)
    layers = range(q if schedule.depends_on_layer else 1)
    rho = sum((structured_rho(schedule.at_layer(i)(pos), schedule.at_layer(i)(pos), groups,
                              allowed) for i in layers), Fraction(0)) / len(layers)
    limit = Fraction(int(groups.sum()), q ** 3)
    fwd, train = attention_speedup_bounds(rho)
    fwd_lim, train_lim = attention_speedup_bounds(limit)
    return {"schedule": cfg.type_schedule, "context": str(n), "rho_score": str(rho),
            "forward_bound": str(fwd), "training_bound": str(train),
            "rho_score_balanced_limit": str(limit), "forward_bound_limit": str(fwd_lim),
            "training_bound_limit": str(train_lim)}


def model_cost(cfg: StructLMConfig) -> dict[str, Any]:
    """Parameters, decode MACs per token and training MACs per token by component."""
    d, f, v, t, n = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.n_positions,
                     cfg.num_hidden_layers)
    rho = _rho(cfg)
    scores = score_cost(cfg)
    rho_s = (Fraction(scores["rho_score"]) if scores and getattr(cfg, "structured_scores", False)
             else Fraction(1))
    dec = {name: n * decode_macs(d, d, d, f, t, r) + d * v
           for name, r in (("dense", Fraction(1)), ("algebra", rho))}
    dec["algebra"] -= n * t * d * (1 - rho_s)  # QK^T of the decoded token at full context
    mean_len = Fraction(t + 1, 2)
    fwd = {
        "attention_projections": (n * 4 * d * d, n * 4 * d * d),
        "attention_scores": (n * 2 * d * mean_len, n * d * mean_len * (1 + rho_s)),
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
        "structured_scores": bool(getattr(cfg, "structured_scores", False)),
        "scores": scores,
    }
