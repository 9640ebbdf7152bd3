"""Tiny random models for the tests (no download, built in milliseconds); on the path via
``pythonpath = ["tests"]`` in pyproject.toml."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tiny_llama"]


def tiny_llama(seed: int = 0, **overrides: Any) -> Any:
    """A random 3-layer GQA ``LlamaForCausalLM`` (hidden 32, 4 query / 2 KV heads, vocab 89,
    tied embeddings) in eval mode; ``overrides`` change any ``LlamaConfig`` field."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    fields = {"num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 89,
              "max_position_embeddings": 64, "tie_word_embeddings": True, **overrides}
    return LlamaForCausalLM(LlamaConfig(**fields)).eval()
