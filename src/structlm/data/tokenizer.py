"""The paper's GPT-2 BPE (50,257 tokens), offline.

The ranks file ``assets/gpt2.tiktoken`` is r50k_base, taken from the PyPI source
package of ``openai-whisper`` (MIT licence, ``assets/LICENSE-gpt2-tiktoken``) and checked
against tiktoken's published hash. :func:`gpt2_encoding` builds a ``tiktoken``
encoding from it; :func:`gpt2_tokenizer` converts it once into a Hugging Face fast
tokenizer (for ``generate`` and lm-evaluation-harness). :func:`load_tokenizer` keeps
the ordinary online path (``AutoTokenizer.from_pretrained``) for users with a hub.
"""

from __future__ import annotations

import hashlib
import os
from functools import cache
from pathlib import Path
from typing import Any

from structlm.settings import cache_dir

__all__ = ["GPT2_TIKTOKEN", "gpt2_encoding", "gpt2_tokenizer", "load_tokenizer"]

GPT2_TIKTOKEN = Path(__file__).with_name("assets") / "gpt2.tiktoken"
_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
EOT = "<|endoftext|>"


@cache
def gpt2_encoding() -> Any:
    """``tiktoken.Encoding`` of GPT-2 (r50k_base): "Hello world" -> [15496, 995]."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str

    digest = hashlib.sha256(GPT2_TIKTOKEN.read_bytes()).hexdigest()
    if digest != _SHA256:
        raise RuntimeError(f"{GPT2_TIKTOKEN} is corrupt: sha256 {digest}, expected {_SHA256}")
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str,
                             mergeable_ranks=load_tiktoken_bpe(str(GPT2_TIKTOKEN)),
                             special_tokens={EOT: 50256}, explicit_n_vocab=50257)


def _cache_dir() -> Path:
    return cache_dir("gpt2-tokenizer")


@cache
def gpt2_tokenizer() -> Any:
    """A Hugging Face ``PreTrainedTokenizerFast`` of GPT-2 built offline (cached on disk
    under ``$STRUCTLM_CACHE``, default ``~/.cache/structlm``)."""
    from tiktoken_ext.openai_public import r50k_pat_str
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    out = _cache_dir() / "tokenizer.json"
    if not out.exists():  # convert once, publish atomically
        gpt2_encoding()  # verifies the file's hash
        out.parent.mkdir(parents=True, exist_ok=True)
        converted = TikTokenConverter(vocab_file=str(GPT2_TIKTOKEN), pattern=r50k_pat_str,
                                      extra_special_tokens={EOT: 50256}).converted()
        tmp = out.with_name(f"tokenizer.json.tmp-{os.getpid()}")
        converted.save(str(tmp))
        os.replace(tmp, out)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(out),
                                  bos_token=EOT, eos_token=EOT, unk_token=EOT)
    tok.pad_token = EOT
    return tok


def load_tokenizer(name: str = "gpt2") -> Any:
    """``"gpt2"``: the offline GPT-2 BPE; anything else: ``AutoTokenizer.from_pretrained``."""
    if name == "gpt2":
        return gpt2_tokenizer()
    from transformers import AutoTokenizer

    if os.path.isdir(name):
        if not any(os.path.exists(os.path.join(name, f)) for f in
                   ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")):
            raise ValueError(f"tokenizer {name!r}: the folder has no tokenizer files "
                             "(tokenizer.json, tokenizer_config.json, ...)")
    elif name.startswith(("/", ".", "~")) or name.count("/") > 1:  # a path, not a hub id
        raise ValueError(f"tokenizer {name!r}: no such folder (expected 'gpt2', a tokenizer "
                         "folder or a hub id)")
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer {name!r} cannot be loaded (expected 'gpt2', a tokenizer "
                         f"folder or a reachable hub id): {str(e).splitlines()[0][:200]}"
                         ) from None
