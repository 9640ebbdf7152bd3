"""Save a compressed model to a folder and load it back with one call.

The folder is self-contained (format 2): ``structlm_compressed.safetensors`` (every
parameter of the compressed model: the untouched weights of the source model plus the
factors; a shared basis is stored once), the source's ``config.json`` and generation
config, its tokenizer, and ``structlm_compression.json`` (method, ranks per type,
calibration, accounting, and the source model by name *and content key* — provenance
only: loading never reads the source). :func:`load_compressed` rebuilds the architecture
from the folder's config, puts factorised modules of the recorded shapes in place and
loads the tensors — the result runs ``generate()`` and perplexity like any causal LM,
from any working directory, after the source is moved or deleted. ``from_pretrained``
loads the folder too once structlm is imported; without structlm, transformers finds no
weights file it knows and refuses (it never builds the dense model with random layers).

Folders of format 1 (earlier versions) hold only the weights and the manifest and read
the config and tokenizer from the source model as it was typed, relative to the working
directory: they still load, with a warning naming what was read;
:func:`make_self_contained` (``structlm share self-contain FOLDER``) upgrades them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from structlm.atomic import atomic_write_text
from structlm.hf.adapters import MatrixType, get_adapter
from structlm.hf.layer_stream import register_streamed_format
from structlm.hf.loading import (
    LoadedModel,
    load_architecture,
    load_model,
    model_content_key,
    register_folder_format,
)
from structlm.share.compress.apply import CompressionConfig, build_modules
from structlm.share.compress.factorize import TypeFactors, TypeRanks
from structlm.share.compress.methods import get_method

__all__ = ["MANIFEST", "SHARDED_INDEX", "WEIGHTS", "compressed_skeleton", "load_compressed",
           "load_source", "make_self_contained", "remove_leftovers", "save_compressed",
           "save_source_files", "source_chain"]

MANIFEST = "structlm_compression.json"
WEIGHTS = "structlm_compressed.safetensors"
SHARDED_INDEX = "structlm_compressed.safetensors.index.json"
"""The index of a folder written layer by layer (tensor → shard file; ``"aliases"``: a
shared tensor's other names → the one it is stored under)."""
"""The weights file (not ``model.safetensors``: transformers without structlm must not
take the folder for a plain model and fill the factorised layers at random)."""
_LEGACY_WEIGHTS = "model.safetensors"  # format 1
FORMAT = 2


def save_source_files(loaded: LoadedModel, folder: Path) -> None:
    """The source's config, generation config and tokenizer into ``folder``."""
    loaded.model.config.save_pretrained(folder)
    generation = getattr(loaded.model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(folder)
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(folder)


def remove_leftovers(folder: str | Path) -> list[Path]:
    """Remove the temporary folders an interrupted :func:`save_compressed` of ``folder``
    left beside it (call only while holding the output's lock); returns them."""
    folder = Path(folder)
    found = sorted(folder.parent.glob(f".tmp-compressed-{folder.name}-*"))
    for left in found:
        shutil.rmtree(left, ignore_errors=True)
    return found


def save_compressed(loaded: LoadedModel, report: dict[str, Any], folder: str | Path,
                    calibration: dict[str, Any] | None = None,
                    source_key: str | None = None) -> Path:
    """Write the compressed model in ``loaded``, its config, tokenizer and manifest
    atomically into ``folder`` (self-contained). ``source_key``: the source model's
    :func:`~structlm.hf.loading.model_content_key`, taken before compression (recorded
    for :func:`load_source`)."""
    from safetensors.torch import save_model

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".tmp-compressed-{folder.name}-"))
    try:
        save_model(loaded.model, str(tmp / WEIGHTS))
        save_source_files(loaded, tmp)
        manifest = {"format": FORMAT, "source_model": loaded.source or loaded.model_id,
                    "source_key": source_key, "source_name": loaded.model_id,
                    "source_note": loaded.note, "compression": report,
                    "calibration": calibration or {}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if folder.exists():
            if not (folder / MANIFEST).is_file():
                raise ValueError(f"{folder} exists and is not a compressed model folder "
                                 f"(no {MANIFEST}): refusing to replace it; choose another "
                                 "output")
            shutil.rmtree(folder)  # an earlier compressed model written here
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _placeholder(t: dict[str, Any], L: int) -> TypeFactors:
    """Factors of the recorded method (a former name resolves to its new one), ranks,
    groups and parts on the ``meta`` device (no memory; the saved tensors are assigned
    afterwards)."""
    try:
        method = get_method(t["method"])
    except ValueError as e:
        raise ValueError(f"unknown compression method {t['method']!r} in the manifest "
                         "(saved by an older structlm? re-run share compress)") from e
    k = int(t["k"])
    ranks = TypeRanks(int(t.get("k_out", k)), int(t.get("k_in", k)), int(t.get("r", 0)))
    sizes = t.get("group_sizes") or [len(g) for g in method.default_groups(L)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    groups = [list(range(s, s + n)) for s, n in zip(starts, sizes, strict=True)]
    out, inn = t["shape"]
    return method.placeholder((out, inn), ranks, groups, int(t.get("parts", 1)))


def _read_saved(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the weights file ``path``, or of every shard its index names (an
    alias of a tensor stored once under another name included)."""
    from safetensors.torch import load_file

    files, aliases = [path], {}
    if path.name == SHARDED_INDEX:
        record = json.loads(path.read_text())
        files = [path.parent / f for f in dict.fromkeys(record["weight_map"].values())]
        aliases = record.get("aliases", {})
    saved: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            saved.update(load_file(str(f)))
        except Exception as e:  # safetensors' own error types: a truncated or foreign file
            raise ValueError(f"{f} cannot be read ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200]}): the weights file is damaged "
                             "or truncated; re-run share compress") from e
    saved.update({a: saved[n] for a, n in aliases.items() if n in saved})
    return saved


def _assign_saved_tensors(model: torch.nn.Module, path: Path) -> None:
    """Point every parameter of ``model`` at the saved tensors (memory-mapped by
    safetensors: no copy; the source model's weights are never read), re-tie tied
    weights, and check that every parameter now comes from the file."""
    saved = _read_saved(path)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # a skeleton from the config may not be tied yet
    aliases: dict[int, list[str]] = {}  # a tensor under several names is saved under one
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    state = dict(saved)
    for names in aliases.values():
        found = next((saved[n] for n in names if n in saved), None)
        if found is not None:
            state.update({n: found for n in names})
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"{path} holds tensors the rebuilt model does not have: "
                         f"{sorted(unexpected)[:5]}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # assign replaced the embedding; the tied head follows it
    from_file = {t.data_ptr() for t in saved.values()}
    left = [n for n, p in model.named_parameters() if p.data_ptr() not in from_file]
    if left:  # never initialised: the architecture was built without weights
        raise ValueError(f"{path} lacks tensors for {left[:5]} (saved by another version?)")


def source_chain(spec: str | Path) -> list[Path]:
    """The folders a model spec reads: the folder itself and, for a compressed model, the
    source model's folders in turn (an output must stay apart from all of them).

    Raises:
        ValueError: a manifest whose chain of sources comes back to a folder already in it.
    """
    chain: list[Path] = []
    current: str | Path | None = spec
    while current is not None and Path(current).exists():
        here = Path(current).resolve()
        if here in chain:
            raise ValueError(f"{chain[0]}: its chain of source models comes back to {here} "
                             f"({MANIFEST} names itself as a source): the folder is damaged")
        chain.append(here)
        manifest = _read_manifest(here, lenient=True) if (here / MANIFEST).is_file() else {}
        current = manifest.get("source_model") if _format(manifest) < FORMAT else None
    return chain  # a self-contained folder (format 2) reads nothing outside itself


def _read_manifest(folder: Path, lenient: bool = False) -> dict[str, Any]:
    """The folder's manifest (a damaged one named; ``lenient``: any JSON object)."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}): the compressed "
                         "folder is damaged; re-run share compress") from e
    if not isinstance(manifest, dict) or not (lenient or isinstance(manifest.get("compression"),
                                                                   dict)):
        raise ValueError(f"{path} is not a compression manifest (no 'compression' record)")
    return manifest


def _format(manifest: dict[str, Any]) -> int:
    return int(manifest.get("format", 1))


def _weights(folder: Path) -> Path:
    """The weights file (format 2's name, else format 1's; a folder half-way through
    :func:`make_self_contained` has one of them), or the index of a sharded folder."""
    for name in (SHARDED_INDEX, WEIGHTS, _LEGACY_WEIGHTS):
        if (folder / name).is_file():
            return folder / name
    raise ValueError(f"{folder} holds no weights ({WEIGHTS}): the compressed folder is "
                     "incomplete; re-run share compress")


def _architecture(folder: Path, manifest: dict[str, Any]) -> LoadedModel:
    """The uninitialised architecture and tokenizer: from the folder itself (format 2) or,
    for a format-1 folder, from its source model (with a warning saying so)."""
    if _format(manifest) >= FORMAT:
        return load_architecture(folder)
    source = str(manifest["source_model"])
    where = os.path.abspath(source) if Path(source).exists() else source
    warnings.warn(f"{folder} was written by an earlier structlm (format 1): it reads its "
                  f"config and tokenizer from the source model {source!r} (here: {where}), "
                  "which must be the model it was compressed from; make it self-contained "
                  f"with: structlm share self-contain {folder}", UserWarning, stacklevel=4)
    return load_model(source, weights=False)  # every tensor is in the file


def compressed_skeleton(folder: str | Path) -> tuple[LoadedModel, dict[str, Any]]:
    """The compressed architecture of ``folder`` — the source's with factorised modules of
    the recorded shapes in place — with no tensor read yet (the factors on ``meta``, the
    rest allocated but untouched), and the folder's manifest: what
    :func:`load_compressed` fills, and what :class:`structlm.hf.layer_stream.StreamedModel`
    streams layer by layer.

    Raises:
        ValueError: not a compressed folder, or a damaged manifest (named).
    """
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.exists():
        raise ValueError(f"{folder} is not a compressed model folder (no {MANIFEST})")
    source_chain(folder)  # refuses a manifest that names itself (or loops) as its source
    manifest = _read_manifest(folder)
    loaded = _architecture(folder, manifest)
    CompressionConfig.from_dict(manifest["compression"]["config"], warn=False)  # validates
    # (a former method name, e.g. "svd", reads as its new one with a DeprecationWarning)
    adapter = get_adapter(loaded.model)
    L = adapter.num_layers
    for name, t in manifest["compression"]["types"].items():
        mt = MatrixType(name)
        factors = _placeholder(t, L)
        biases = [adapter.layers[i].bias(mt) for i in range(L)]
        for layer, mod in zip(adapter.layers, build_modules(factors, biases), strict=True):
            layer.replace(mt, mod)
    return loaded, manifest


def load_compressed(folder: str | Path) -> LoadedModel:
    """The compressed model saved in ``folder`` (by :func:`save_compressed`, or layer by
    layer by :func:`structlm.share.compress.streamed.compress_streamed`).

    Raises:
        ValueError: not a compressed folder, a damaged manifest or weights file (named).
    """
    folder = Path(folder)
    loaded, manifest = compressed_skeleton(folder)
    ccfg = CompressionConfig.from_dict(manifest["compression"]["config"], warn=False)
    _assign_saved_tensors(loaded.model, _weights(folder))
    loaded.model.eval()
    source_name = manifest.get("source_name") or manifest.get("source_model")
    loaded.note = (manifest.get("source_note") or "") + \
        ("; " if manifest.get("source_note") else "") + \
        f"compressed ({ccfg.method}) from {source_name}"
    loaded.model_id = str(folder)
    loaded.source = str(folder)
    return loaded


def load_source(folder: str | Path) -> LoadedModel:
    """The (uncompressed) model ``folder`` was compressed from, for a comparison against
    it; checked by content where the manifest records the source's key.

    Raises:
        ValueError: the source cannot be found, or a model of that name with other
            content (another folder that happens to have the name).
    """
    manifest = _read_manifest(Path(folder))
    source = str(manifest["source_model"])
    recorded = manifest.get("source_key")
    if recorded is not None:
        found = model_content_key(source)
        if found != recorded:
            raise ValueError(f"{folder} was compressed from {source!r} with content key "
                             f"{recorded}, but {source!r} here "
                             f"({os.path.abspath(source) if Path(source).exists() else 'not found'}"
                             f") has {found or 'no local files'}: not the same model; pass the "
                             "original model instead")
    return load_model(source)


def make_self_contained(folder: str | Path) -> bool:
    """Upgrade a format-1 compressed folder in place to format 2: copy its source model's
    config, generation config and tokenizer in, rename the weights, then rewrite the
    manifest (each step atomic; an interrupted upgrade loads and can be run again).
    Returns ``False`` when the folder is self-contained already.

    Raises:
        ValueError: not a compressed folder, or its source cannot be loaded.
    """
    folder = Path(folder)
    manifest = _read_manifest(folder)
    if _format(manifest) >= FORMAT:
        return False
    source = str(manifest["source_model"])
    try:
        loaded = load_model(source, weights=False)
    except (ValueError, OSError, RuntimeError) as e:
        raise ValueError(f"{folder}: its source model {source!r} cannot be loaded from here "
                         f"({str(e).splitlines()[0][:300]}): run this where the folder was "
                         "written, or with the source model at that path") from e
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".tmp-self-contain-"))
    try:
        save_source_files(loaded, tmp)
        for f in tmp.iterdir():
            os.replace(f, folder / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if (folder / _LEGACY_WEIGHTS).is_file():
        os.replace(folder / _LEGACY_WEIGHTS, folder / WEIGHTS)
    manifest.update(format=FORMAT, source_key=manifest.get("source_key"),
                    source_path=os.path.abspath(source) if Path(source).exists() else source)
    atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=1))
    return True


register_folder_format(MANIFEST, load_compressed)
register_streamed_format(SHARDED_INDEX, lambda folder: compressed_skeleton(folder)[0].model)
