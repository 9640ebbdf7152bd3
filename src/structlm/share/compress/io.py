"""Save a compressed model to a folder and load it back with one call.

The folder holds ``model.safetensors`` (every parameter of the compressed model: the
untouched weights of the source model plus the factors; a shared basis is stored once)
and ``structlm_compression.json`` (method, ranks per type, source model, calibration,
accounting). :func:`load_compressed` rebuilds the source architecture, puts factorised
modules of the recorded shapes in place and loads the tensors — the result runs
``generate()`` and perplexity like any causal LM.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from structlm.hf.adapters import MatrixType, get_adapter
from structlm.hf.loading import LoadedModel, load_model, register_folder_format
from structlm.share.compress.apply import CompressionConfig, build_modules
from structlm.share.compress.factorize import TypeFactors, TypeRanks
from structlm.share.compress.methods import get_method

__all__ = ["MANIFEST", "load_compressed", "save_compressed", "source_chain"]

MANIFEST = "structlm_compression.json"


def save_compressed(loaded: LoadedModel, report: dict[str, Any], folder: str | Path,
                    calibration: dict[str, Any] | None = None) -> Path:
    """Write the compressed model in ``loaded`` and its manifest atomically."""
    from safetensors.torch import save_model

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-compressed-"))
    try:
        save_model(loaded.model, str(tmp / "model.safetensors"))
        manifest = {"format": 1, "source_model": loaded.source or loaded.model_id,
                    "source_name": loaded.model_id, "source_note": loaded.note,
                    "compression": report, "calibration": calibration or {}}
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


def _assign_saved_tensors(model: torch.nn.Module, path: Path) -> None:
    """Point every parameter of ``model`` at the saved tensors (memory-mapped by
    safetensors: no copy; the source model's weights are never read), re-tie tied
    weights, and check that every parameter now comes from the file."""
    from safetensors.torch import load_file

    saved = load_file(str(path))
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
        manifest = here / MANIFEST
        current = (json.loads(manifest.read_text()).get("source_model")
                   if manifest.is_file() else None)
    return chain


def load_compressed(folder: str | Path) -> LoadedModel:
    """The compressed model saved in ``folder`` (by :func:`save_compressed`)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.exists():
        raise ValueError(f"{folder} is not a compressed model folder (no {MANIFEST})")
    source_chain(folder)  # refuses a manifest that names itself (or loops) as its source
    manifest = json.loads(path.read_text())
    loaded = load_model(manifest["source_model"], weights=False)  # every tensor is in the file
    ccfg = CompressionConfig.from_dict(manifest["compression"]["config"])  # validates
    # (a former method name, e.g. "svd", reads as its new one with a DeprecationWarning)
    adapter = get_adapter(loaded.model)
    L = adapter.num_layers
    for name, t in manifest["compression"]["types"].items():
        mt = MatrixType(name)
        factors = _placeholder(t, L)
        biases = [adapter.layers[i].bias(mt) for i in range(L)]
        for layer, mod in zip(adapter.layers, build_modules(factors, biases), strict=True):
            layer.replace(mt, mod)
    _assign_saved_tensors(loaded.model, folder / "model.safetensors")
    loaded.model.eval()
    loaded.note = (manifest.get("source_note") or "") + \
        ("; " if manifest.get("source_note") else "") + \
        f"compressed ({ccfg.method}) from {loaded.model_id}"
    loaded.model_id = str(folder)
    loaded.source = str(folder)
    return loaded


register_folder_format(MANIFEST, load_compressed)
