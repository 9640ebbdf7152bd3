"""Data: tokenizers (GPT-2 offline, trained BPE in ``bpe``), built-in corpora and the
corpus loader (``corpora.load_corpus``), decontamination checks, and packed,
memory-mapped token files (``tokens``)."""

from structlm.data.tokenizer import GPT2_TIKTOKEN, gpt2_encoding, gpt2_tokenizer, load_tokenizer

__all__ = ["GPT2_TIKTOKEN", "gpt2_encoding", "gpt2_tokenizer", "load_tokenizer"]
