"""Input second moments with the attention-sink positions left out.

The calibration (:mod:`structlm.hf.calibration`) averages ``x xᵀ`` over every
position of every window. The first positions of a window carry the attention sink —
huge activations in a few directions — which dominate ``E[x xᵀ]`` and collapse the
functional effective ranks of test 3 to 1–2. :func:`sink_excluded_second_moments`
re-runs the *same* calibration tokens (cut into the same windows) with its own forward
pre-hooks on ``adapter.layers[i].site_module(site)`` and accumulates, with
:class:`~structlm.hf.calibration.CovarianceAccumulator` (float64, streaming), only the
positions ``sink_tokens, …, seq_len − 1`` of every window. The result is cached next to
the calibration file when its path is known.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from structlm.hf.adapters import ModelAdapter
from structlm.hf.calibration import SITES, SavedTensors, calibrate, calibration_windows

__all__ = ["calibration_windows", "sink_excluded_second_moments"]


def _accumulate(adapter: ModelAdapter, seqs: torch.Tensor, batch_size: int,
                layers: list[int], sites: tuple[str, ...], sink_tokens: int,
                progress: bool) -> dict[tuple[int, str], torch.Tensor]:
    """The calibration pass itself, with the first ``sink_tokens`` positions skipped."""
    cal = calibrate(adapter, seqs, batch_size=batch_size, layers=layers, sites=sites,
                    progress=progress, skip_positions=sink_tokens, desc="sink-excluded pass")
    return cal.second_moments


def _cache_path(calibration_path: str, meta: dict[str, Any]) -> Path:
    key = hashlib.sha1(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:12]
    return Path(calibration_path).with_suffix(f".sinks-{key}.safetensors")


def _load(path: Path) -> SavedTensors | None:
    """The cached moments, read on access (``None``: a damaged cache, recomputed)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            names = list(fh.keys())
    except Exception:  # a damaged cache is recomputed
        return None
    return SavedTensors(path, [(int(n.split(".")[0]), n.split(".")[1]) for n in names])


def _save(path: Path, moments: dict[tuple[int, str], torch.Tensor]) -> None:
    from safetensors.torch import save_file

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        save_file({f"{layer}.{site}": c.contiguous() for (layer, site), c in moments.items()},
                  tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def sink_excluded_second_moments(adapter: ModelAdapter, tokens: torch.Tensor, seq_len: int,
                                 batch_size: int, layers: list[int], sites: tuple[str, ...],
                                 sink_tokens: int, cache_meta: dict[str, Any] | None = None,
                                 calibration_path: str | None = None, progress: bool = True
                                 ) -> Mapping[tuple[int, str], torch.Tensor]:
    """``E[x xᵀ]`` (float64, uncentred) of ``sites`` in ``layers`` over the windows of
    ``tokens`` (``(n, w)`` windows, or ``(N,)`` ids cut into ``N // seq_len`` windows —
    :func:`calibration_windows`, exactly as the calibration cuts them), leaving out the
    first ``sink_tokens`` positions of every window.

    With ``calibration_path`` (the calibration's cache file) and ``cache_meta`` (what
    identifies the run: model, corpus, documents, seed) the result is cached beside it,
    keyed also by a hash of the token ids, and reused when the same tokens, layers,
    sites, window and ``sink_tokens`` are asked for again; the cached moments are read
    one ``(layer, site)`` at a time (:class:`SavedTensors`), not held in memory."""
    seqs = calibration_windows(tokens, seq_len)
    if not 0 < sink_tokens < seqs.shape[1]:
        raise ValueError(f"sink_tokens must be in (0, {seqs.shape[1]}), got {sink_tokens}")
    bad = [s for s in sites if s not in SITES]
    if bad:
        raise ValueError(f"unknown sites {bad}: expected some of {SITES}")
    path = None
    if calibration_path and cache_meta is not None:
        ids = seqs.to(torch.int64).contiguous()
        meta = {**cache_meta, "windows": list(ids.shape),
                "token_sha1": hashlib.sha1(ids.numpy().tobytes()).hexdigest(),
                "sink_tokens": sink_tokens, "layers": sorted(layers), "sites": sorted(sites)}
        path = _cache_path(calibration_path, meta)
        if path.exists():
            cached = _load(path)
            if cached is not None and all((i, s) in cached for i in layers for s in sites):
                return cached
    moments = _accumulate(adapter, seqs, batch_size, layers, sites, sink_tokens, progress)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _save(path, moments)
        del moments
        saved = _load(path)
        assert saved is not None
        return saved
    return moments
