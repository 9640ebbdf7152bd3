"""``compress_``: the one entry point of compression, beside ``convert_``.

A model held in memory is compressed in place (:func:`~.apply.compress_model`); a model
on disk (a folder of safetensors shards, or a built-in name) is compressed one layer (or
Basis Sharing group) at a time into a new sharded folder
(:func:`~.streamed.compress_streamed`), never held whole. ``structlm share compress``
calls this function for both.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from structlm.hf.calibration import Calibration, calibrate
from structlm.hf.fingerprint import tensor_fingerprint
from structlm.share.compress.apply import CompressionConfig, compress_model

__all__ = ["compress_"]


def compress_(model_or_folder: nn.Module | str | Path,
              config: CompressionConfig | str | None = None,
              calibration: torch.Tensor | Calibration | None = None, *,
              calib_tokens: torch.Tensor | None = None, out: str | Path | None = None,
              seq_len: int = 512, progress: bool = True) -> dict[str, Any]:
    """Compress ``model_or_folder`` under ``config``; returns the compression report
    (original and stored parameters per type and for the model, ranks, kept energy).

    ``model_or_folder``:

    * a Hugging Face causal LM of a family with an adapter: compressed **in place**
      (every input checked first; an error part-way puts every module back);
    * a folder of safetensors shards or a built-in model name
      (``qwen2.5-coder-1.5b``): compressed layer by layer into the new folder ``out``
      (required; sharded, resumable per unit after a kill, moved into place in one
      rename), peak memory set by one layer or Basis Sharing group. Methods that need
      every layer at once (``shared``/``hybrid`` under a budget,
      ``onesided-all-layers``, an update pass) are refused with the reason.

    ``config``: a :class:`CompressionConfig`, or a method name (every other field at its
    default); ``None``: ``CompressionConfig()``.

    ``calibration``: token ids (``(n, seq_len)`` windows, or ``(N,)`` ids cut into
    windows of ``seq_len``) whose input second moments are accumulated first (for a
    folder: layer by layer, cached under the structlm cache keyed on the weights' and the
    ids' content), or a :class:`~structlm.hf.calibration.Calibration` already made from
    this model (then ``calib_tokens``: its ids, needed by the methods that refit on the
    compressed model's inputs).

    Raises:
        TypeError: ``config`` or ``calibration`` of the wrong kind.
        ValueError: no calibration; a folder without ``out``; anything the method or
            the streamed pipeline refuses (named, before any module is replaced).
    """
    cfg = _config(config)
    if calibration is None:
        raise ValueError("compress_ needs calibration: token ids (n, seq_len) or a "
                         "Calibration of this model")
    if not isinstance(calibration, torch.Tensor | Calibration):
        raise TypeError(f"calibration must be token ids (a tensor) or a Calibration, got "
                        f"{type(calibration).__name__}")
    if isinstance(model_or_folder, nn.Module):
        from structlm.hf.adapters import get_adapter

        adapter = get_adapter(model_or_folder)  # refuses a model of no known family
        if isinstance(calibration, torch.Tensor):
            calib_tokens = calibration
            calibration = calibrate(adapter, calibration, seq_len=seq_len, progress=progress)
        return compress_model(adapter, calibration, cfg, progress=progress,
                              calib_tokens=calib_tokens)
    if not isinstance(model_or_folder, str | Path):
        raise TypeError(f"compress_ takes a Hugging Face causal LM, a model folder or a "
                        f"built-in name, got {type(model_or_folder).__name__}")
    if out is None:
        raise ValueError("compress_ of a model on disk writes a new folder: give out=")
    return _compress_folder(str(model_or_folder), cfg, calibration, Path(out), seq_len,
                            progress)


def _config(config: CompressionConfig | str | None) -> CompressionConfig:
    if config is None:
        return CompressionConfig()
    if isinstance(config, str):
        return CompressionConfig(method=config)
    if not isinstance(config, CompressionConfig):
        raise TypeError(f"config must be a CompressionConfig or a method name, got "
                        f"{type(config).__name__}")
    return config


def streamed_calibration_folder(source_key: str | None, ids: torch.Tensor) -> Path:
    """Where the layer-by-layer calibration of a model (its content key) on ``ids`` is
    cached: keyed on both contents, never on a path."""
    from structlm.settings import cache_dir

    key = hashlib.sha1(json.dumps({"model_files": source_key, "calibration_tokens":
                                   tensor_fingerprint(ids)}, sort_keys=True).encode()
                       ).hexdigest()[:16]
    return cache_dir("calibration") / f"streamed-{key}"


def _compress_folder(spec: str, cfg: CompressionConfig, calibration: torch.Tensor |
                     Calibration, out: Path, seq_len: int, progress: bool) -> dict[str, Any]:
    from structlm.folders import check_apart, run_folder_lock
    from structlm.hf.layer_stream import StreamedModel, stream_folder
    from structlm.hf.loading import load_model, model_content_key
    from structlm.hf.streamed_calibration import calibrate_streamed
    from structlm.share.compress.io import MANIFEST, source_chain
    from structlm.share.compress.streamed import compress_streamed

    folder = stream_folder(spec, "on")  # refuses, with the reason, what cannot stream
    assert folder is not None
    if (folder / MANIFEST).is_file():
        raise ValueError(f"{spec!r} is a compressed folder: compress the model it was "
                         "compressed from (its manifest names it)")
    check_apart(out, source_chain(spec))
    source = load_model(spec, weights=False)
    source_key = model_content_key(spec)
    with run_folder_lock(out.parent, "compressed model output"):
        if isinstance(calibration, torch.Tensor):
            ids = calibration
            meta = {"model_files": source_key, "calibration_tokens": tensor_fingerprint(ids),
                    "model": source.model_id}
            calibration = calibrate_streamed(
                StreamedModel(folder), ids, streamed_calibration_folder(source_key, ids),
                seq_len=seq_len, meta=meta, progress=progress)
        return compress_streamed(StreamedModel(folder), calibration, cfg, out, source,
                                 dict(calibration.meta), source_key, progress)
