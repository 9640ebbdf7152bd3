"""Equal-MAC baselines for a converted model (their MACs and parameters are counted by
:mod:`structlm.hf.macs`).

* :func:`prune_ffn_width_` — structured FFN-width pruning: keep, in every layer, the
  ``F'`` hidden units with the largest calibration importance
  ``score_j = ||W_out[:, j]||_2 · sqrt(E[h_j^2])`` (``h`` the input of MLP-out, i.e. the
  unit's activation, ``W_out[:, j]`` the weights it writes with: the RMS size of the
  unit's contribution to the residual stream, a structured form of the
  |weight| x |activation| scores of the pruning literature). Not a re-implementation of
  a published method (no layer-wise width allocation, no bias compensation), so it is
  named for what it does.
* per-layer low-rank factorisation: ``structlm.share.compress`` with method ``svd``
  (whitened truncated SVD, SVD-LLM's factorisation) at a parameter reduction equal to
  the MAC reduction (for a rank-``r`` factorisation both are ``r (m + n)``).
"""

from __future__ import annotations

import torch
from torch import nn

from structlm.hf.adapters import MatrixType, get_adapter
from structlm.hf.calibration import Calibration

__all__ = ["ffn_importance", "prune_ffn_width_"]


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"


def ffn_importance(model: nn.Module, calibration: Calibration) -> list[torch.Tensor]:
    """Per layer, the importance ``(F,)`` float64 of each FFN hidden unit (see the module
    docstring), from the float64 second moments of MLP-out's input."""
    adapter = get_adapter(model)
    scores = []
    for layer in adapter.layers:
        c = calibration.C(layer.index, MatrixType.MLP_OUT)  # (F, F) float64
        w = layer.weight(MatrixType.MLP_OUT).double()  # (d, F)
        scores.append(w.norm(dim=0) * c.diagonal().clamp_min(0).sqrt())
    return scores


def prune_ffn_width_(model: nn.Module, calibration: Calibration, keep: int) -> list[list[int]]:
    """Keep ``keep`` hidden units of every FFN layer (by :func:`ffn_importance`), in
    place: MLP-in rows (gate and up alike) and MLP-out columns. Returns the kept units
    per layer (sorted)."""
    adapter = get_adapter(model)
    scores = ffn_importance(model, calibration)
    kept_all: list[list[int]] = []
    for layer, score in zip(adapter.layers, scores, strict=True):
        f = score.numel()
        if not 1 <= keep <= f:
            raise ValueError(f"keep={keep} hidden units: expected 1..{f}")
        kept = torch.topk(score, keep).indices.sort().values
        for site in layer.linear_sites():
            if MatrixType.MLP_IN in site.types:
                rows = kept
                if _out_width(site.module) == 2 * f:  # a fused [gate; up] (Phi-3)
                    rows = torch.cat([kept, kept + f])
                setattr(site.parent, site.attr, _slice(site.module, rows, outputs=True))
            elif MatrixType.MLP_OUT in site.types:
                setattr(site.parent, site.attr, _slice(site.module, kept, outputs=False))
        kept_all.append(kept.tolist())
    return kept_all


def _out_width(module: nn.Module) -> int:
    return int(module.weight.shape[1] if _is_conv1d(module) else module.weight.shape[0])


def _slice(module: nn.Module, kept: torch.Tensor, outputs: bool) -> nn.Module:
    """``module`` restricted to the ``kept`` hidden units: its outputs (MLP-in) or its
    inputs (MLP-out); a GPT-2 ``Conv1D`` stores ``(in, out)``. Only plain projections
    (an algebra or factorised module would silently become dense)."""
    if not (type(module) is nn.Linear or _is_conv1d(module)):
        raise ValueError(f"width pruning needs plain nn.Linear / Conv1D projections, got a "
                         f"{type(module).__name__} (prune the original model)")
    w, b = module.weight.detach(), None if module.bias is None else module.bias.detach()
    if _is_conv1d(module):
        w = w.t()  # (out, in)
    w = w[kept] if outputs else w[:, kept]
    b = b[kept] if (outputs and b is not None) else b
    if _is_conv1d(module):
        new = type(module)(w.shape[0], w.shape[1])
        new.to(device=w.device, dtype=w.dtype)
        with torch.no_grad():
            new.weight.copy_(w.t())
            if b is not None:
                new.bias.copy_(b)
        return new
    new = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w)
        if b is not None:
            new.bias.copy_(b)
    return new
