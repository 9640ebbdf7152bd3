"""Tiny random models for the tests (no download, built in milliseconds); on the path via
``pythonpath = ["tests"]`` in pyproject.toml."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tiny_gpt2", "tiny_llama", "tiny_structlm"]


def tiny_llama(seed: int = 0, **overrides: Any) -> Any:
    """A random 3-layer GQA ``LlamaForCausalLM`` (hidden 32, 4 query / 2 KV heads, vocab 89,
    tied embeddings) in eval mode; ``overrides`` change any ``LlamaConfig`` field."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    fields = {"num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 89,
              "max_position_embeddings": 64, "tie_word_embeddings": True, **overrides}
    return LlamaForCausalLM(LlamaConfig(**fields)).eval()


def tiny_gpt2(seed: int = 0, **overrides: Any) -> Any:
    """A random 3-layer ``GPT2LMHeadModel`` (n_embd 48, 4 heads, vocab 97) in eval mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    fields = {"n_layer": 3, "n_embd": 48, "n_head": 4, "n_positions": 64, "vocab_size": 97,
              **overrides}
    return GPT2LMHeadModel(GPT2Config(**fields)).eval()


def tiny_structlm(seed: int = 0, algebra: str = "dense", **overrides: Any) -> Any:
    """A random 3-layer ``StructLMForCausalLM`` (hidden 32, 4 heads, FFN 64, vocab 97) in
    eval mode, with FFN ``algebra``."""
    from structlm.models import StructLMConfig, StructLMForCausalLM

    torch.manual_seed(seed)
    fields = {"num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 4,
              "intermediate_size": 64, "vocab_size": 97, "n_positions": 64,
              "algebra": algebra, **overrides}
    return StructLMForCausalLM(StructLMConfig(**fields)).eval()
