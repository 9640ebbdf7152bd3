"""A byte-level BPE trained on a corpus's training documents (Hugging Face ``tokenizers``).

For CPU-sized studies the GPT-2 vocabulary (50,257) makes the LM head the largest
product of a small model; a vocabulary of a few thousand tokens trained on the training
split keeps the comparison about the layers being compared. Byte-level, GPT-2's
pre-tokenisation, ``<|endoftext|>`` as token 0 (document separator, BOS/EOS/pad).
Trained on training documents only, never on validation text.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from structlm.data.tokenizer import EOT

__all__ = ["load_bpe", "parse_tokenizer_spec", "train_bpe"]

MIN_VOCAB = 260
"""256 byte tokens, ``<|endoftext|>`` and a few merges."""


def parse_tokenizer_spec(spec: str) -> int | None:
    """``"gpt2"`` -> ``None``; ``"bpe:<vocab>"`` -> the vocabulary size. Anything else is
    an error naming the expected forms."""
    text = spec.strip().lower()
    if text == "gpt2":
        return None
    if text.startswith("bpe:"):
        try:
            vocab = int(text[4:])
        except ValueError:
            vocab = -1
        if not MIN_VOCAB <= vocab <= 65535:
            raise ValueError(f"tokenizer {spec!r}: the BPE vocabulary must be an integer in "
                             f"[{MIN_VOCAB}, 65535] (tokens are stored as uint16)")
        return vocab
    raise ValueError(f"unknown tokenizer {spec!r}: expected 'gpt2' or 'bpe:<vocab size>'")


def train_bpe(texts: Sequence[str], vocab_size: int, out_dir: str | os.PathLike[str]) -> Any:
    """Train a byte-level BPE of ``vocab_size`` tokens on ``texts`` and save it as a
    Hugging Face tokenizer folder (written atomically); returns the loaded tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the corpus yields only {tok.get_vocab_size()} BPE tokens, fewer "
                         f"than the {vocab_size} asked for: use a smaller vocabulary")
    out = Path(out_dir)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    _wrap(tmp).save_pretrained(str(tmp))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return load_bpe(out)


def _wrap(folder: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                  bos_token=EOT, eos_token=EOT, unk_token=EOT, pad_token=EOT)
    return tok


def load_bpe(folder: str | os.PathLike[str]) -> Any:
    """The tokenizer :func:`train_bpe` saved in ``folder`` (``PreTrainedTokenizerFast``)."""
    return _wrap(Path(folder))
