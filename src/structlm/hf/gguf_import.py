"""A GGUF file as an ordinary Hugging Face folder, converted tensor by tensor.

``transformers`` loads a GGUF by de-quantising every tensor into memory first (9.1 GB
resident for the 1.5B Qwen2.5-Coder). :func:`gguf_to_sharded_folder` uses the same
pieces of ``transformers`` (its config and tokenizer readers, its GGUF → Hugging Face
name map and per-architecture tensor processors) and the ``gguf`` package's reader
(memory-mapped) and de-quantisation, but goes **one shard at a time**: each decoder
layer's tensors are de-quantised and written into their own safetensors file
(``model-layer-007.safetensors``), every other tensor into a file of its own, with the
usual ``model.safetensors.index.json``. Memory holds one shard (one layer, or the
embedding), never the model; the folder then loads layer by layer
(:mod:`structlm.hf.layer_stream`) or whole (``from_pretrained``).

The work happens in ``.partial-<name>`` beside the destination, under a lock (a second
process converting the same file waits for the first, then finds the folder done), each
shard written atomically: a conversion killed part-way resumes at the first missing shard.
The finished folder is moved into place in one rename.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from structlm.atomic import atomic_path, atomic_write_text

__all__ = ["SHARD_INDEX", "gguf_to_sharded_folder", "shard_of"]

SHARD_INDEX = "model.safetensors.index.json"
"""The Hugging Face index of a sharded safetensors folder (tensor name → file)."""

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def shard_of(name: str) -> str:
    """The shard file a tensor goes to: ``model-layer-NNN.safetensors`` for decoder layer
    NNN's tensors, ``model-<name>.safetensors`` for any other (dots as dashes, without a
    leading ``model.`` or a trailing ``.weight``: ``model-embed_tokens.safetensors``)."""
    m = _LAYER.search(name)
    if m:
        return f"model-layer-{int(m.group(1)):03d}.safetensors"
    stem = re.sub(r"^model\.|\.(weight|bias)$", "", name).replace(".", "-")
    return f"model-{stem}.safetensors"


@contextmanager
def _waiting_lock(folder: Path) -> Iterator[None]:
    """Hold ``folder/.lock``, waiting for another holder to finish."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def gguf_to_sharded_folder(gguf: str | Path, dest: str | Path, dtype: torch.dtype =
                           torch.float32, progress: bool = True) -> Path:
    """Convert the GGUF file ``gguf`` into a Hugging Face folder ``dest`` (config,
    generation config, tokenizer, one safetensors shard per decoder layer and per other
    tensor, index) in ``dtype``, one shard in memory at a time; returns ``dest``.

    ``dest`` already holding a ``config.json`` is returned as it is.

    Raises:
        ValueError: a file that is not a GGUF, an architecture ``transformers`` cannot
            read from GGUF, or a GGUF lacking tensors the architecture needs (named).
    """
    src, dest = Path(gguf), Path(dest)
    if (dest / "config.json").exists():
        return dest
    with src.open("rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ValueError(f"{src} is not a GGUF file (no GGUF magic)")
    work = dest.parent / f".partial-{dest.name}"
    with _waiting_lock(work):
        if (dest / "config.json").exists():  # another process finished while we waited
            return dest
        _convert(src, work, dtype, progress)
        (work / ".lock").unlink()
        os.replace(work, dest)  # lock released on a path that is gone: harmless
    return dest


def _convert(src: Path, work: Path, dtype: torch.dtype, progress: bool) -> None:
    from gguf import GGUFReader, dequantize
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    try:
        config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
        parsed = load_gguf_checkpoint(str(src), return_tensors=False)
    except (ValueError, NotImplementedError) as e:
        raise ValueError(f"{src}: transformers cannot read this GGUF ({e})") from e
    reader = GGUFReader(str(src))  # memory-mapped: nothing read until a tensor is used
    architecture = _field(reader, "general.architecture")
    with torch.device("meta"):  # names and shapes only, nothing allocated
        skeleton = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    name_map = get_gguf_hf_weights_map(skeleton, processor)
    wanted = _wanted_tensors(skeleton, config)
    groups: dict[str, list[Any]] = {}
    for tensor in reader.tensors:
        hf_name = name_map.get(tensor.name)
        if hf_name in wanted:
            groups.setdefault(shard_of(hf_name), []).append(tensor)
    weight_map: dict[str, str] = {}
    for shard, tensors in tqdm(sorted(groups.items()), desc=f"converting {src.name}",
                               unit="shard", disable=not progress):
        names = [name_map[t.name] for t in tensors]
        weight_map.update(dict.fromkeys(names, shard))
        if (work / shard).exists():  # written before an interruption
            continue
        out: dict[str, torch.Tensor] = {}
        for t, hf_name in zip(tensors, names, strict=True):
            result = processor.process(weights=_dequantised(t, dequantize), name=t.name,
                                       tensor_key_mapping=name_map, parsed_parameters=parsed)
            value = torch.from_numpy(np.require(result.weights, requirements=["C", "W"]))
            value = value.to(dtype)
            if tuple(value.shape) != wanted[hf_name]:
                raise ValueError(f"{src}: tensor {t.name} ({hf_name}) has shape "
                                 f"{tuple(value.shape)}, the architecture expects "
                                 f"{wanted[hf_name]}")
            out[hf_name] = value
        with atomic_path(work / shard, ".safetensors") as tmp:
            save_file(out, str(tmp), metadata={"format": "pt"})
        del out
    missing = sorted(set(wanted) - set(weight_map))
    if missing:
        raise ValueError(f"{src} lacks {len(missing)} tensors the {config.model_type} "
                         f"architecture needs ({', '.join(missing[:4])}"
                         f"{', ...' if len(missing) > 4 else ''})")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    total = sum(itemsize * _numel(wanted[n]) for n in weight_map)
    atomic_write_text(work / SHARD_INDEX, json.dumps(
        {"metadata": {"total_size": total, "source": src.name}, "weight_map": weight_map},
        indent=1))
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    config.dtype = dtype
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(work))
    if skeleton.generation_config is not None:
        skeleton.generation_config.save_pretrained(str(work))
    tok.save_pretrained(str(work))
    for left in work.glob(".tmp-*"):  # a killed shard write's temporary
        left.unlink()
    shutil.rmtree(work / "__pycache__", ignore_errors=True)


_ROWS_PER_CHUNK = 4096
"""Rows de-quantised at once (the ``gguf`` package's intermediates are several times
its output: a 151,936-row embedding de-quantised whole would add gigabytes)."""


def _dequantised(tensor: Any, dequantize: Any) -> np.ndarray:
    """``tensor`` de-quantised to float32, a chunk of rows at a time."""
    data = tensor.data
    if data.ndim != 2 or data.shape[0] <= _ROWS_PER_CHUNK:
        return np.asarray(dequantize(data, tensor.tensor_type), dtype=np.float32)
    first = dequantize(data[:_ROWS_PER_CHUNK], tensor.tensor_type)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=np.float32)
    out[:_ROWS_PER_CHUNK] = first
    for a in range(_ROWS_PER_CHUNK, data.shape[0], _ROWS_PER_CHUNK):
        out[a:a + _ROWS_PER_CHUNK] = dequantize(data[a:a + _ROWS_PER_CHUNK],
                                                tensor.tensor_type)
    return out


def _field(reader: Any, key: str) -> str:
    from transformers.modeling_gguf_pytorch_utils import read_field

    value = read_field(reader, key)
    if not value:
        raise ValueError(f"the GGUF has no {key!r} field")
    return str(value[0])


def _wanted_tensors(skeleton: Any, config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture stores (name → shape), the tied head left out."""
    state = skeleton.state_dict()
    tied: set[str] = set()
    out = skeleton.get_output_embeddings()
    if getattr(config, "tie_word_embeddings", False) and out is not None:
        tied = {f"{n}.weight" for n, m in skeleton.named_modules() if m is out}
    return {n: tuple(t.shape) for n, t in state.items() if n not in tied}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
