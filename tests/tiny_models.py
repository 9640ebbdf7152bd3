"""Tiny random models for the tests (no download, built in milliseconds); on the path via
``pythonpath = ["tests"]`` in pyproject.toml."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FAMILY_OVERRIDES", "tiny_family", "tiny_gpt2", "tiny_llama", "tiny_structlm",
           "validation_of"]


def validation_of(ids: torch.Tensor) -> Any:
    """``(n, w)`` ids as validation windows (what fine-tuning's curve accepts)."""
    from structlm.hf.splits import Role, Windows

    return Windows(ids, Role.VALIDATION, "validation:test")


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


#: Per model_type, what makes a small random model of the family typical: Gemma's
#: head_dim unrelated to hidden/heads and one KV head (multi-query), Gemma 3's
#: sliding-window layers, Qwen3's own head_dim; the rest as in :func:`tiny_family`.
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma2": {"head_dim": 16, "num_key_value_heads": 1},
    "gemma3_text": {"head_dim": 16, "num_key_value_heads": 1, "sliding_window": 8},
    "gemma3": {"head_dim": 16, "num_key_value_heads": 1, "sliding_window": 8},
    "qwen3": {"head_dim": 12},
    "olmo2": {},
    "phi3": {},
    "qwen2": {},  # q/k/v biases
    "mistral": {},
}


def tiny_family(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """A random 3-layer causal LM of ``model_type`` (hidden 48, 4 query / 2 KV heads
    unless the family's :data:`FAMILY_OVERRIDES` say otherwise, FFN 80, vocab 97) in eval
    mode, built offline from its config class; ``gemma3`` is the multimodal model (a
    one-layer vision tower beside the text decoder)."""
    from transformers import AutoConfig, AutoModelForCausalLM, Gemma3Config

    fields = {"num_hidden_layers": 3, "hidden_size": 48, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 80, "vocab_size": 97,
              "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 0, **FAMILY_OVERRIDES[model_type], **overrides}
    if model_type == "gemma3":
        cfg = Gemma3Config(text_config=fields, vision_config={
            "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
            mm_tokens_per_image=4)
    else:
        cfg = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()
