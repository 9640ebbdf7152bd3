"""Data: tokenizers (corpora, packing and memory-mapped token files come next)."""

from .tokenizer import GPT2_TIKTOKEN, gpt2_encoding, gpt2_tokenizer, load_tokenizer

__all__ = ["GPT2_TIKTOKEN", "gpt2_encoding", "gpt2_tokenizer", "load_tokenizer"]
