"""``StructLMConfig``: a Hugging Face config for the paper's decoder with algebra FFNs."""

from __future__ import annotations

from typing import Annotated, Any

from transformers import PretrainedConfig

from structlm.config import ConfigError, OneOf, Range, coerce

__all__ = ["FIELD_TYPES", "StructLMConfig", "check_config_values"]

_POSITIVE = Annotated[int, Range(ge=1)]
_TOKEN_ID = Annotated[int | None, Range(ge=0)]

FIELD_TYPES: dict[str, Any] = {
    "vocab_size": _POSITIVE, "n_positions": _POSITIVE, "hidden_size": _POSITIVE,
    "num_hidden_layers": _POSITIVE, "num_attention_heads": _POSITIVE,
    "intermediate_size": _POSITIVE, "algebra": str, "type_schedule": str,
    "structured_scores": bool, "layer_norm_epsilon": Annotated[float, Range(gt=0)],
    "initializer_range": Annotated[float, Range(gt=0)], "tie_word_embeddings": bool,
    "bos_token_id": _TOKEN_ID, "eos_token_id": _TOKEN_ID, "pad_token_id": _TOKEN_ID,
    "algebra_init": Annotated[str, OneOf("dense", "variance-matched")],
}
"""The type and valid range of every :class:`StructLMConfig` field a caller sets (what
``TrainConfig.model_overrides`` may hold)."""


def check_config_values(values: dict[str, Any], where: str = "") -> dict[str, Any]:
    """``values`` (fields of :class:`StructLMConfig`) coerced to their types and checked
    against their ranges.

    Raises:
        ConfigError: an unknown key, or a value of the wrong type or out of range, named
            as ``<where><key>``.
    """
    unknown = sorted(set(values) - set(FIELD_TYPES))
    if unknown:
        raise ConfigError(f"{where.rstrip('.')}: unknown keys {unknown}; expected some of "
                          f"{sorted(FIELD_TYPES)}")
    return {k: coerce(v, FIELD_TYPES[k], where + k) for k, v in values.items()}


class StructLMConfig(PretrainedConfig):
    """Pre-norm decoder: learned absolute positions, LayerNorm, biased multi-head
    attention, bias-free SwiGLU FFN whose three projections are ``AlgebraLinear``
    (or dense), tied LM head.

    Args:
        vocab_size: tokens (50,257 for GPT-2 BPE).
        n_positions: context length (learned position embeddings).
        hidden_size: model width ``D``.
        num_hidden_layers: blocks.
        num_attention_heads: heads (``D`` must be divisible by it).
        intermediate_size: SwiGLU width ``F``.
        algebra: ``"dense"`` or a catalogue name (``"Q2^2"``, ``"Q4"``, ...) for the FFN.
        type_schedule: position types from absolute positions: ``"block"`` (the paper's
            ``floor((p mod 768) / 192)`` for q = 4), ``"block:<size>"``, ``"cyclic"``,
            ``"cross-layer:<one of these>"`` (type shifted by the layer index).
        structured_scores: structured attention scores (seed 000 appendix G): a type-``i``
            query scores a type-``j`` key on head-dimension groups ``F(i, j)`` only
            (:mod:`structlm.nn.structured_scores`); off by default, as in the paper's LM.
        layer_norm_epsilon: LayerNorm epsilon.
        initializer_range: std of the normal initialisation.
        algebra_init: ``"dense"`` (every weight ``N(0, initializer_range^2)``, as a dense
            layer) or ``"variance-matched"``: an algebra projection's weights get the std
            scaled by ``1/sqrt(f)`` per output feature, ``f`` the fraction of the input a
            row of that output group sees, averaged over the position types (9/16 on
            average for ``Q2^2``), so each output's variance at init matches a dense
            layer's for unit-variance inputs. Dense projections are unaffected.
    """

    model_type = "structlm"

    def __init__(
        self,
        vocab_size: int = 50257,
        n_positions: int = 1536,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 32,
        intermediate_size: int = 1536,
        algebra: str = "dense",
        type_schedule: str = "block",
        structured_scores: bool = False,
        layer_norm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        bos_token_id: int = 50256,
        eos_token_id: int = 50256,
        algebra_init: str = "dense",
        **kwargs: Any,
    ) -> None:
        given = {"vocab_size": vocab_size, "n_positions": n_positions,
                 "hidden_size": hidden_size, "num_hidden_layers": num_hidden_layers,
                 "num_attention_heads": num_attention_heads,
                 "intermediate_size": intermediate_size, "algebra": algebra,
                 "type_schedule": type_schedule, "structured_scores": structured_scores,
                 "layer_norm_epsilon": layer_norm_epsilon,
                 "initializer_range": initializer_range,
                 "tie_word_embeddings": tie_word_embeddings, "bos_token_id": bos_token_id,
                 "eos_token_id": eos_token_id, "algebra_init": algebra_init}
        if "pad_token_id" in kwargs:
            given["pad_token_id"] = kwargs["pad_token_id"]
        c = check_config_values(given)  # types and ranges, named
        if "pad_token_id" in kwargs:
            kwargs["pad_token_id"] = c["pad_token_id"]
        vocab_size, n_positions, hidden_size = c["vocab_size"], c["n_positions"], c["hidden_size"]
        num_hidden_layers, num_attention_heads = c["num_hidden_layers"], c["num_attention_heads"]
        intermediate_size, algebra, type_schedule = (c["intermediate_size"], c["algebra"],
                                                     c["type_schedule"])
        structured_scores, tie_word_embeddings = c["structured_scores"], c["tie_word_embeddings"]
        layer_norm_epsilon, initializer_range = c["layer_norm_epsilon"], c["initializer_range"]
        bos_token_id, eos_token_id = c["bos_token_id"], c["eos_token_id"]
        if hidden_size % num_attention_heads:
            raise ValueError(f"hidden_size={hidden_size} is not divisible by "
                             f"num_attention_heads={num_attention_heads}")
        self.vocab_size = vocab_size
        self.n_positions = n_positions
        self.max_position_embeddings = n_positions
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.algebra = algebra
        self.type_schedule = type_schedule
        self.structured_scores = bool(structured_scores)
        from structlm.algebra import is_dense, num_types

        q = num_types(algebra)
        bad = {k: v for k, v in (("hidden_size", hidden_size),
                                 ("intermediate_size", intermediate_size)) if v % q}
        if bad:
            raise ValueError(f"algebra {algebra!r} splits the FFN's widths into q={q} "
                             f"equal groups: {bad} not divisible by {q}")
        if self.structured_scores:
            if is_dense(algebra):
                raise ValueError("structured_scores needs an algebra (the query and key "
                                 "types come from its position types), got algebra='dense'")
            head = hidden_size // num_attention_heads
            if head % q:
                raise ValueError(f"structured_scores splits each head into q={q} groups: "
                                 f"head size {head} (hidden_size={hidden_size} / "
                                 f"num_attention_heads={num_attention_heads}) is not "
                                 f"divisible by {q}")
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.algebra_init = c["algebra_init"]
        super().__init__(tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, **kwargs)
