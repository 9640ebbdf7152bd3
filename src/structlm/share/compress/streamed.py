"""Compression one unit of layers at a time, the model's weights left on disk.

:func:`compress_streamed` gives what :func:`~structlm.share.compress.apply.compress_model`
gives — the same factors from the same weights and moments, the same report — without
ever holding the model: the layers are cut into *units* (the layer groups of every
compressed type merged: one layer for ``svd-llm-w``, ``group_size`` consecutive layers for
Basis Sharing), and each unit in turn is made resident
(:class:`~structlm.hf.layer_stream.StreamedModel`), factorised under the global plan (its
ranks solved once for the whole model), its modules replaced, its tensors written to
their own shard (a basis shared inside the unit stored once, its other names recorded
as aliases), and released. A shard and a small record of the unit are written
atomically as soon as it is done: a run killed part-way resumes at the first unit
without one. The other tensors (embedding, final norm, head) are copied one by one,
then the index, the source's config and tokenizer, and the manifest (format 3); the
folder is moved into place in one rename.

Methods whose ranks come from all layers' data (``shared``, ``hybrid`` under a budget),
one group of every layer (``onesided-all-layers``) or an update pass over the compressed
model (``svd-llm``, Basis Sharing's ``update``) are refused here with the reason.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from structlm.atomic import atomic_path, atomic_write_text
from structlm.cpu_malloc import release_freed_memory, returning_freed_memory
from structlm.hf.calibration import Calibration
from structlm.hf.gguf_import import shard_of
from structlm.hf.layer_stream import StreamedModel
from structlm.hf.loading import LoadedModel
from structlm.share.compress.apply import (
    CompressionConfig,
    TypePlan,
    build_modules,
    factorize_plan,
    finish_report,
    plan_types,
    type_entry,
)
from structlm.share.compress.factorize import RootCache
from structlm.share.compress.io import MANIFEST, SHARDED_INDEX, save_source_files
from structlm.share.compress.methods import get_method
from structlm.tensor_files import write_safetensors

__all__ = ["FORMAT_SHARDED", "compress_streamed", "stream_units", "why_not_streamed"]

FORMAT_SHARDED = 3
"""The manifest format of a folder written layer by layer (sharded weights)."""

_ROOT_MEMORY = 512 << 20
"""Whitening roots kept in memory within a unit: a 4,096-wide pair (268 MB, read by Q, K
and V) is kept, an 8,960-wide one (1.3 GB, read by one type) is not."""


def stream_units(plans: list[TypePlan], num_layers: int) -> list[list[int]]:
    """The layers cut into consecutive units that no type's layer group crosses."""
    cut = set(range(1, num_layers))
    for plan in plans:
        for group in plan.groups:
            cut -= set(range(min(group) + 1, max(group) + 1))
    edges = [0, *sorted(cut), num_layers]
    return [list(range(a, b)) for a, b in itertools.pairwise(edges)]


def why_not_streamed(cfg: CompressionConfig, plans: list[TypePlan], L: int) -> str | None:
    """Why ``cfg`` cannot compress layer by layer (the reason, to print), or ``None``."""
    method = get_method(cfg.method)
    update = cfg.basis_sharing.update
    if method.runs_update(update):
        return (f"method {cfg.method!r}{' with update' if update else ''} refits every "
                "layer on the compressed model's own inputs: not streamed layer by layer yet")
    for plan in plans:
        if plan.ranks is None:
            return (f"method {plan.method!r} chooses the ranks of {plan.type.value} from "
                    "every layer's data at once: it cannot stream layer by layer")
        deeper = L + cfg.basis_sharing.group_size  # this deep: still one group of all?
        if L > 1 and any(len(g) == deeper for g in method.layout(plan.type, deeper, cfg)[1]):
            return (f"method {cfg.method!r} shares one basis across all {L} layers for "
                    f"{plan.type.value}: streaming would hold every layer")
    return None


def _check_streamable(cfg: CompressionConfig, plans: list[TypePlan], L: int) -> None:
    why = why_not_streamed(cfg, plans, L)
    if why is not None:
        raise ValueError(f"{why} (use --stream off)")


def _local(plan: TypePlan, unit: list[int]) -> TypePlan:
    """``plan`` restricted to the layers of ``unit`` (groups renumbered from 0)."""
    first = unit[0]
    groups = [[i - first for i in g] for g in plan.groups if g[0] in unit]
    return dataclasses.replace(plan, groups=groups)


@returning_freed_memory()
def compress_streamed(stream: StreamedModel, cal: Calibration, cfg: CompressionConfig,
                      folder: str | Path, source: LoadedModel, calibration: dict[str, Any],
                      source_key: str | None, progress: bool = True) -> dict[str, Any]:
    """Compress the model ``stream`` streams under ``cfg`` into the compressed folder
    ``folder`` (module docstring; ``source``: its tokenizer and names for the folder and
    manifest); returns the report :func:`compress_model` would give. The caller holds
    ``folder``'s parent's lock (one writer).

    Raises:
        ValueError: a method that cannot stream (module docstring), named with why.
    """
    folder = Path(folder)
    L = stream.num_layers
    plans = plan_types(stream.adapter, cfg)
    _check_streamable(cfg, plans, L)
    for plan in plans:  # every moment the factorisations read exists: checked first
        cal.layer_moments(plan.type, list(range(L)))
    total = sum(p.numel() for p in stream.model.parameters())  # before any replacement
    work = folder.parent / f".partial-{folder.name}"
    work.mkdir(parents=True, exist_ok=True)
    units = stream_units(plans, L)
    energies: dict[str, list[float]] = {p.type.value: [] for p in plans}
    infos: dict[str, dict[str, Any]] = {}
    weight_map: dict[str, str] = {}
    aliases: dict[str, str] = {}
    for unit in tqdm(units, desc="compress (units of layers)", unit="unit",
                     disable=not progress):
        record = _unit_record(work, unit)
        if not record.is_file():
            _compress_unit(stream, cal, cfg, plans, unit, work)
        done = json.loads(record.read_text())
        for t, e in done["energy"].items():
            energies[t] += e
        for t, info in done["info"].items():
            infos.setdefault(t, info)
        weight_map.update(done["weight_map"])
        aliases.update(done["aliases"])
    weight_map.update(_copy_rest(stream, work))
    report: dict[str, Any] = {"config": dataclasses.asdict(cfg), "types": {}}
    orig_sum = stored_sum = 0
    for plan in plans:
        assert plan.ranks is not None
        entry = type_entry(plan.method, plan.ranks, plan.shape, plan.parts,
                           [len(g) for g in plan.groups], plan.budget,
                           energies[plan.type.value], infos.get(plan.type.value, {}))
        orig_sum += entry["original_parameters"]
        stored_sum += entry["stored_parameters"]
        report["types"][plan.type.value] = entry
    report = finish_report(report, orig_sum, stored_sum, total)
    atomic_write_text(work / SHARDED_INDEX, json.dumps(
        {"metadata": {"format": FORMAT_SHARDED}, "weight_map": weight_map,
         "aliases": aliases}, indent=1))
    save_source_files(source, work)
    manifest = {"format": FORMAT_SHARDED, "source_model": source.source or source.model_id,
                "source_key": source_key, "source_name": source.model_id,
                "source_note": source.note, "compression": report,
                "calibration": calibration, "streamed": True}
    for left in work.glob("unit-*.json"):
        left.unlink()
    atomic_write_text(work / MANIFEST, json.dumps(manifest, indent=1))
    if folder.exists():
        if not (folder / MANIFEST).is_file():
            raise ValueError(f"{folder} exists and is not a compressed model folder (no "
                             f"{MANIFEST}): refusing to replace it; choose another output")
        shutil.rmtree(folder)  # an earlier compressed model written here
    os.replace(work, folder)
    return report


def _unit_record(work: Path, unit: list[int]) -> Path:
    return work / f"unit-{unit[0]:03d}-{unit[-1]:03d}.json"


def _compress_unit(stream: StreamedModel, cal: Calibration, cfg: CompressionConfig,
                   plans: list[TypePlan], unit: list[int], work: Path) -> None:
    """Factorise every planned type in the layers of ``unit``, write their tensors and
    the unit's record."""
    layers = [stream.adapter.layers[i] for i in unit]
    roots = RootCache(cfg.eig_floor, memory_bytes=_ROOT_MEMORY)
    energy: dict[str, list[float]] = {}
    info: dict[str, Any] = {}
    with ExitStack() as stack:
        for i in unit:
            stack.enter_context(stream.resident(stream.blocks[i]))
        for plan in plans:
            t = plan.type
            weights = [layer.weight(t) for layer in layers]
            factors = factorize_plan(_local(plan, unit), weights,
                                     cal.layer_moments(t, unit), cfg, roots)  # read on use
            del weights
            biases = [layer.bias(t) for layer in layers]
            for layer, mod in zip(layers, build_modules(factors, biases), strict=True):
                layer.replace(t, mod)
            energy[t.value], info[t.value] = factors.energy, factors.info
            del factors, biases  # float64 factors: not held while the next type's run
            release_freed_memory()
        tensors, aliases = _unit_tensors(stream, unit)
        shard = (f"structlm_compressed-layer-{unit[0]:03d}.safetensors" if len(unit) == 1
                 else f"structlm_compressed-layers-{unit[0]:03d}-{unit[-1]:03d}.safetensors")
        with atomic_path(work / shard, ".safetensors") as tmp:
            write_safetensors(tensors, tmp, {"format": "pt"})  # no bytes copy of the unit
    record = {"layers": unit, "energy": energy,
              "info": {t: {k: v for k, v in i.items() if k != "group_sizes"}
                       for t, i in info.items()},
              "weight_map": dict.fromkeys(tensors, shard), "aliases": aliases}
    atomic_write_text(_unit_record(work, unit), json.dumps(record, indent=1))


def _unit_tensors(stream: StreamedModel, unit: list[int]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the unit's layers by its full name, a tensor shared by several
    names stored under the first (the others returned as aliases)."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[tuple[int, int], str] = {}
    for i in unit:
        prefix = stream.name_prefix(stream.blocks[i])
        for k, v in stream.blocks[i].state_dict(keep_vars=False).items():
            key = (v.data_ptr(), v.numel())
            if key in first_name and v.numel():
                aliases[prefix + k] = first_name[key]
                continue
            first_name[key] = prefix + k
            tensors[prefix + k] = v.detach().contiguous()
    return tensors, aliases


def _copy_rest(stream: StreamedModel, work: Path) -> dict[str, str]:
    """The tensors outside the layers (embedding, final norm, untied head), one file each,
    copied one at a time; their weight map."""
    blocks = tuple(stream.name_prefix(b) for b in stream.blocks)
    names = [n for n in stream.weights.file_of if not n.startswith(blocks)]
    out = {}
    for name in names:
        shard = "structlm_compressed-" + shard_of(name)[len("model-"):]
        out[name] = shard
        if (work / shard).is_file():
            continue
        tensor = stream.weights.read([name])[name]
        if tensor.is_floating_point():  # the dtype the factors are written in
            tensor = tensor.to(stream.dtype)
        with atomic_path(work / shard, ".safetensors") as tmp:
            write_safetensors({name: tensor}, tmp, {"format": "pt"})
        del tensor
    return out
