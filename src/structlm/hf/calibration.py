"""Input statistics of every matrix: float64 second moments, streamed through hooks.

``calibrate`` runs calibration tokens through the model once with a forward pre-hook on
one module per (layer, input site) — Q, K and V read the same site — and accumulates
``sum x x^T`` and ``sum x`` in float64 without keeping activations. ``C_l`` below is the
*uncentred* second moment ``E[x x^T]``: a linear layer's output energy is
``E||W x||^2 = tr(W C W^T)``; the mean is stored too. Results are saved as safetensors
with the model id, corpus, token count and seed in the metadata, and reused when those
match (:func:`load_or_calibrate`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import torch
from tqdm import tqdm

from structlm.hf.adapters import SITE_OF, MatrixType, ModelAdapter

__all__ = ["Calibration", "CovarianceAccumulator", "NonFiniteActivationError", "SavedTensors",
           "calibrate", "calibration_windows", "load_or_calibrate"]

SITES = ("attn_in", "attn_out", "mlp_in", "mlp_out")


class NonFiniteActivationError(RuntimeError):
    """A calibration activation was NaN or infinite."""


class CovarianceAccumulator:
    """Streaming float64 ``sum x x^T``, ``sum x`` and row count of ``(..., d)`` inputs."""

    def __init__(self, d: int) -> None:
        self.xx = torch.zeros(d, d, dtype=torch.float64)
        self.x = torch.zeros(d, dtype=torch.float64)
        self.n = 0

    def update(self, x: torch.Tensor) -> None:
        """Add the rows of ``x`` ``(..., d)``; raises on non-finite values."""
        rows = x.detach().reshape(-1, x.shape[-1]).to("cpu", torch.float64)  # (R, d)
        if not torch.isfinite(rows).all():
            raise NonFiniteActivationError(f"non-finite activation in a ({rows.shape[0]}, "
                                           f"{rows.shape[1]}) batch")
        self.xx.addmm_(rows.T, rows)
        self.x += rows.sum(0)
        self.n += rows.shape[0]

    def second_moment(self) -> torch.Tensor:
        """``E[x x^T]`` ``(d, d)`` float64."""
        if self.n == 0:
            raise ValueError("no rows accumulated")
        return self.xx / self.n

    def mean(self) -> torch.Tensor:
        return self.x / max(self.n, 1)


class SavedTensors(Mapping[tuple[int, str], torch.Tensor]):
    """``(layer, site) -> tensor`` read from a safetensors file on every access, nothing
    held in memory: a 24-layer model's float64 second moments of a 4,864-wide MLP input
    are 4.5 GB, and every consumer needs one layer at a time.

    Tensor names in the file are ``f"{layer}.{site}{suffix}"``; ``path`` is one file, or
    a mapping from each key to the file holding it (a calibration written layer by layer,
    :mod:`structlm.hf.streamed_calibration`). The files are keyed on content by whoever
    wrote them, so they cannot change under the view."""

    def __init__(self, path: str | Path | Mapping[tuple[int, str], str | Path],
                 keys: list[tuple[int, str]], suffix: str = "") -> None:
        self._files = ({k: str(v) for k, v in path.items()} if isinstance(path, Mapping)
                       else dict.fromkeys(keys, str(path)))
        self.path = str(path) if not isinstance(path, Mapping) else ""
        self._keys = list(keys)
        self._set = set(self._keys)
        self.suffix = suffix

    def __getitem__(self, key: tuple[int, str]) -> torch.Tensor:
        if key not in self._set:
            raise KeyError(key)
        from structlm.tensor_files import read_safetensors

        name = f"{key[0]}.{key[1]}{self.suffix}"
        return read_safetensors(self._files[key], [name])[name]

    def __iter__(self) -> Iterator[tuple[int, str]]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._set


@dataclass
class Calibration:
    """Second moments ``C[(layer, site)]`` (float64) and the run that produced them
    (in memory after :func:`calibrate`; read layer by layer from the file after
    :meth:`load`)."""

    meta: dict[str, Any]
    second_moments: Mapping[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    means: Mapping[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    def C(self, layer: int, t: MatrixType) -> torch.Tensor:
        """Input second moment of matrix ``t`` in ``layer``."""
        key = (layer, SITE_OF[t])
        if key not in self.second_moments:
            raise KeyError(f"no calibration for layer {layer}, site {key[1]} (calibrated "
                           f"layers: {sorted({k[0] for k in self.second_moments})})")
        return self.second_moments[key]

    def layer_moments(self, t: MatrixType, layers: list[int]) -> Sequence[torch.Tensor]:
        """``[C(i, t) for i in layers]``, each read when indexed (a saved calibration's
        24 float64 moments of a 4,864-wide MLP input are 4.5 GB; nobody needs them at
        once)."""
        for i in layers:  # a missing one fails here, not halfway through
            if (i, SITE_OF[t]) not in self.second_moments:
                self.C(i, t)
        return _LayerMoments(self, t, list(layers))

    def save(self, path: str | Path) -> None:
        """Write atomically as safetensors (metadata holds the run description)."""
        from structlm.tensor_files import write_safetensors

        tensors = {}
        for (layer, site), c in self.second_moments.items():
            tensors[f"{layer}.{site}.second_moment"] = c.contiguous()
            tensors[f"{layer}.{site}.mean"] = self.means[(layer, site)].contiguous()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            write_safetensors(tensors, tmp, {"structlm": json.dumps(self.meta)})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """The calibration saved at ``path``; its tensors are read on access
        (:class:`SavedTensors`), one ``(layer, site)`` at a time."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {}).get("structlm", "{}"))
            keys = [(int(layer), site) for layer, site, kind in
                    (k.split(".") for k in fh.keys()) if kind == "second_moment"]
        return cls(meta=meta, second_moments=SavedTensors(path, keys, ".second_moment"),
                   means=SavedTensors(path, keys, ".mean"))


class _LayerMoments(Sequence[torch.Tensor]):
    """:meth:`Calibration.layer_moments`."""

    def __init__(self, cal: Calibration, t: MatrixType, layers: list[int]) -> None:
        self.cal, self.t, self.layers = cal, t, layers

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...
    def __getitem__(self, i: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(i, slice):
            return [self.cal.C(j, self.t) for j in self.layers[i]]
        return self.cal.C(self.layers[i], self.t)

    def __len__(self) -> int:
        return len(self.layers)

    def owned(self, i: int) -> torch.Tensor:
        """``self[i]`` as a tensor the caller may overwrite: a fresh read from a saved
        calibration, a copy of one held in memory."""
        C = self[i]
        return C if isinstance(self.cal.second_moments, SavedTensors) else C.clone()


def calibration_windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The ``(n, w)`` windows the calibration runs: ``tokens`` itself when it is already
    ``(n, w)`` windows, else ``(N,)`` ids cut into ``N // seq_len`` windows of
    ``seq_len`` (the remainder dropped)."""
    if tokens.dim() == 2:
        seq_len = tokens.shape[1]
    n_seq = tokens.numel() // seq_len
    if n_seq == 0:
        raise ValueError(f"{tokens.numel()} tokens are fewer than one window of {seq_len}")
    return tokens.reshape(-1)[: n_seq * seq_len].view(n_seq, seq_len)


def calibrate(adapter: ModelAdapter, tokens: torch.Tensor, seq_len: int = 512,
              batch_size: int = 4, layers: list[int] | None = None,
              sites: tuple[str, ...] = SITES, meta: dict[str, Any] | None = None,
              progress: bool = True, skip_positions: int = 0,
              desc: str = "calibration") -> Calibration:
    """Accumulate input second moments of ``sites`` in ``layers`` over ``tokens``
    (``(n, w)`` windows, one sequence each, or ``(N,)`` ids cut into ``N // seq_len``
    sequences; the remainder is dropped). ``skip_positions``: leave out the first positions
    of every window (the attention-sink positions, :mod:`structlm.share.analysis.sinks`)."""
    seqs = calibration_windows(tokens, seq_len)
    n_seq, seq_len = seqs.shape
    layers = list(range(adapter.num_layers)) if layers is None else list(layers)
    bad = [s for s in sites if s not in SITES]
    if bad:
        raise ValueError(f"unknown sites {bad}: expected some of {SITES}")
    accs: dict[tuple[int, str], CovarianceAccumulator] = {}
    handles = []

    def hook_for(key: tuple[int, str]) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, args: tuple[Any, ...], *_: Any) -> None:
            x = args[0]
            if skip_positions:
                if x.dim() < 3:
                    raise ValueError(f"site {key[1]} of layer {key[0]} gets a {x.dim()}-dim "
                                     "input: positions cannot be told apart")
                x = x[:, skip_positions:]  # (batch, positions, d)
            if key not in accs:
                accs[key] = CovarianceAccumulator(x.shape[-1])
            accs[key].update(x)
        return hook

    for i in layers:
        for site in sites:
            mod = adapter.layers[i].site_module(site)
            handles.append(mod.register_forward_pre_hook(hook_for((i, site))))
    model = adapter.model
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for start in tqdm(range(0, n_seq, batch_size), desc=desc, unit="batch",
                              disable=not progress):
                model(input_ids=seqs[start:start + batch_size].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    cal = Calibration(meta={**(meta or {}), "tokens_used": n_seq * seq_len, "seq_len": seq_len,
                            "layers": layers, "sites": list(sites), "version": 1})
    moments: dict[tuple[int, str], torch.Tensor] = {}
    means: dict[tuple[int, str], torch.Tensor] = {}
    for key in list(accs):  # in place, one accumulator at a time: no second copy
        acc = accs.pop(key)
        if acc.n == 0:
            raise ValueError(f"no rows reached site {key[1]} of layer {key[0]}")
        means[key] = acc.mean()
        moments[key] = acc.xx.div_(acc.n)
    cal.second_moments, cal.means = moments, means
    return cal


def load_or_calibrate(path: str | Path, adapter: ModelAdapter, tokens: torch.Tensor,
                      meta: dict[str, Any], **kwargs: Any) -> Calibration:
    """The saved calibration at ``path`` if its metadata matches ``meta`` (model id,
    corpus, token count, seed, ...) and covers the requested layers; else a new one,
    saved there."""
    path = Path(path)
    want_layers = kwargs.get("layers") or list(range(adapter.num_layers))
    if path.exists():
        old = Calibration.load(path)
        if all(old.meta.get(k) == v for k, v in meta.items()) \
                and set(want_layers) <= set(old.meta.get("layers", [])) \
                and old.meta.get("seq_len") == kwargs.get("seq_len", 512):
            return old
    cal = calibrate(adapter, tokens, meta=meta, **kwargs)
    cal.save(path)
    del cal  # read back layer by layer: the float64 moments need not stay in memory
    return Calibration.load(path)
