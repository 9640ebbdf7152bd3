"""Model presets (data, not code): the paper's 110M run and CPU-sized models."""

from __future__ import annotations

from typing import Any

from structlm.models.configuration_structlm import StructLMConfig

__all__ = ["PRESETS", "config_from_preset"]

PRESETS: dict[str, dict[str, Any]] = {
    # the paper's LM: 110,631,168 trainable parameters, dense or Q2^2
    "paper-110m": dict(vocab_size=50257, n_positions=1536, hidden_size=768,
                       num_hidden_layers=12, num_attention_heads=32, intermediate_size=1536),
    # trains on 2 CPU cores in minutes
    "cpu-small": dict(vocab_size=50257, n_positions=512, hidden_size=256,
                      num_hidden_layers=4, num_attention_heads=8, intermediate_size=512),
    # structlm experiment study (configs/study/cpu.yaml): the FFN (F = 4D) carries ~70% of the
    # non-embedding MACs; the vocabulary follows the study's BPE tokenizer
    "study-cpu": dict(vocab_size=8192, n_positions=256, hidden_size=256, num_hidden_layers=4,
                      num_attention_heads=8, intermediate_size=1024, bos_token_id=0,
                      eos_token_id=0),
    # for tests
    "study-tiny": dict(vocab_size=512, n_positions=64, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=128, bos_token_id=0,
                       eos_token_id=0),
    "tiny": dict(vocab_size=512, n_positions=128, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=64, bos_token_id=0, eos_token_id=0),
}


def config_from_preset(name: str, algebra: str = "dense", **overrides: Any) -> StructLMConfig:
    """A config from a preset name, with the FFN algebra and any field overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: expected one of {sorted(PRESETS)}")
    return StructLMConfig(**{**PRESETS[name], "algebra": algebra, **overrides})
