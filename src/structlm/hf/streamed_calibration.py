"""Input second moments of every matrix, computed one decoder layer at a time.

:func:`calibrate_streamed` gives exactly what :func:`structlm.hf.calibration.calibrate`
gives (the same float64 sums, batch by batch in the same order: tested bitwise) from a
:class:`~structlm.hf.layer_stream.StreamedModel`, whose weights stay on disk: the
calibration windows are embedded once, then each layer is made resident, its sites'
inputs accumulated through forward pre-hooks while the windows' hidden states pass
through it, and released. Memory: one layer, the hidden states of all windows
(``(n, T, d)`` float32) and one layer's moments (a 8,960-wide MLP input's is 642 MB).

The result is a folder: one safetensors file per layer (``layer-NNN.safetensors``,
tensors ``"{layer}.{site}.second_moment"`` and ``".mean"``) written atomically as soon
as the layer is done, the hidden states after the last finished layer
(``carry.safetensors``), and ``calibration.json`` (the run's description) once every
layer is done. A run killed part-way resumes after its last finished layer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from structlm.atomic import atomic_path, atomic_write_text
from structlm.cpu_malloc import returning_freed_memory
from structlm.hf.calibration import (
    SITES,
    Calibration,
    CovarianceAccumulator,
    SavedTensors,
    calibration_windows,
)
from structlm.hf.layer_stream import LayerInputs, StreamedModel

__all__ = ["calibrate_streamed", "load_streamed_calibration"]

_DONE = "calibration.json"
_CARRY = "carry.safetensors"


def _layer_file(folder: Path, i: int) -> Path:
    return folder / f"layer-{i:03d}.safetensors"


def load_streamed_calibration(folder: str | Path) -> Calibration | None:
    """The finished calibration in ``folder`` (its tensors read on access), or ``None``
    when the folder holds no finished run."""
    folder = Path(folder)
    if not (folder / _DONE).is_file():
        return None
    meta = json.loads((folder / _DONE).read_text())
    files = {(int(i), s): str(_layer_file(folder, int(i)))
             for i in meta["layers"] for s in meta["sites"]}
    keys = list(files)
    return Calibration(meta=meta, second_moments=SavedTensors(files, keys, ".second_moment"),
                       means=SavedTensors(files, keys, ".mean"))


@returning_freed_memory()
def calibrate_streamed(stream: StreamedModel, tokens: torch.Tensor, folder: str | Path,
                       seq_len: int = 512, batch_size: int = 4,
                       sites: tuple[str, ...] = SITES, meta: dict[str, Any] | None = None,
                       progress: bool = True) -> Calibration:
    """Second moments of ``sites`` in every layer of ``stream`` over ``tokens`` (windows
    ``(n, w)`` or ids ``(N,)`` cut into ``seq_len`` windows), written layer by layer into
    ``folder`` (module docstring); a finished ``folder`` is read back as it is, a
    part-done one resumed. The caller keys ``folder`` on content (model and tokens).

    Raises:
        ValueError: unknown ``sites``; a part-done ``folder`` of other windows.
    """
    bad = [s for s in sites if s not in SITES]
    if bad:
        raise ValueError(f"unknown sites {bad}: expected some of {SITES}")
    folder = Path(folder)
    done = load_streamed_calibration(folder)
    if done is not None:
        return done
    seqs = calibration_windows(tokens, seq_len)
    n_seq, seq_len = seqs.shape
    batches = [seqs[a:a + batch_size] for a in range(0, n_seq, batch_size)]
    folder.mkdir(parents=True, exist_ok=True)
    inputs = stream.capture(batches)
    start = _resume(folder, inputs, seqs)
    L = stream.num_layers
    for i in tqdm(range(start, L), desc="calibration (layers)", unit="layer",
                  disable=not progress, initial=start, total=L):
        moments = _layer_moments(stream, i, inputs, sites)
        with atomic_path(_layer_file(folder, i), ".safetensors") as tmp:
            _save(moments, tmp, {"layer": str(i)})
        del moments
        with atomic_path(folder / _CARRY, ".safetensors") as tmp:
            _save({"hidden": torch.cat([b.hidden for b in inputs])}, tmp,
                  {"after_layer": str(i), "windows": _windows_key(seqs)})
    (folder / _CARRY).unlink(missing_ok=True)
    record = {**(meta or {}), "tokens_used": n_seq * seq_len, "seq_len": seq_len,
              "layers": list(range(L)), "sites": list(sites), "version": 1,
              "streamed": True}
    atomic_write_text(folder / _DONE, json.dumps(record, indent=1))
    done = load_streamed_calibration(folder)
    assert done is not None
    return done


def _windows_key(seqs: torch.Tensor) -> str:
    from structlm.hf.fingerprint import tensor_fingerprint

    return tensor_fingerprint(seqs)


def _resume(folder: Path, inputs: list[LayerInputs], seqs: torch.Tensor) -> int:
    """The first layer still to do; the carried hidden states put back into ``inputs``."""
    carry = folder / _CARRY
    if not carry.is_file():
        return 0
    from safetensors import safe_open

    with safe_open(str(carry), framework="pt") as fh:
        info = fh.metadata() or {}
        if info.get("windows") != _windows_key(seqs):
            raise ValueError(f"{folder} holds a part-done calibration of other windows: "
                             "its folder must be keyed on the calibration tokens")
        hidden = fh.get_tensor("hidden")
    after = int(info["after_layer"])
    if not _layer_file(folder, after).is_file():
        raise ValueError(f"{folder}: the carried states are after layer {after}, whose "
                         "moments are missing: remove the folder to start again")
    a = 0
    for b in inputs:
        b.hidden = hidden[a:a + b.hidden.shape[0]].clone()
        a += b.hidden.shape[0]
    return after + 1


def _layer_moments(stream: StreamedModel, i: int, inputs: list[LayerInputs],
                   sites: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Layer ``i``'s sites' moments (tensors named ``"{i}.{site}.second_moment"`` /
    ``".mean"``) while every batch's hidden states pass through it."""
    accs: dict[str, CovarianceAccumulator] = {}
    layer = stream.adapter.layers[i]
    with stream.resident(stream.blocks[i]) as block:
        modules = [layer.site_module(s) for s in sites]

        def hook_for(site: str) -> Callable[..., None]:
            def hook(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
                x = args[0]  # (b, T, d)
                if site not in accs:
                    accs[site] = CovarianceAccumulator(x.shape[-1])
                accs[site].update(x)
            return hook

        handles = [m.register_forward_pre_hook(hook_for(s)) for m, s in
                   zip(modules, sites, strict=True)]
        try:
            with torch.no_grad():
                for b in inputs:
                    args, kwargs = b.calls[i]
                    y = block(b.hidden, *args, **kwargs)
                    b.hidden = y if isinstance(y, torch.Tensor) else y[0]
        finally:
            for h in handles:
                h.remove()
    out: dict[str, torch.Tensor] = {}
    for site in sites:
        acc = accs.pop(site, None)
        if acc is None or acc.n == 0:
            raise ValueError(f"no rows reached site {site} of layer {i}")
        out[f"{i}.{site}.mean"] = acc.mean()
        out[f"{i}.{site}.second_moment"] = acc.xx.div_(acc.n)
    return out


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    from structlm.tensor_files import write_safetensors

    write_safetensors(tensors, path, metadata)  # no bytes copy of a layer's moments
