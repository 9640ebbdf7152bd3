"""Where a converted model's error sits: per converted module and position type, against
the dense model it came from.

For every converted module the student's input ``x_s`` and output ``y_s`` and the dense
teacher's output ``y_t`` (the teacher on its own activations) are recorded on the same
token ids, and two relative errors are summed in float64 per position type:

* ``local`` — ``|y_s - A x_s|^2 / |A x_s|^2``, ``A`` the teacher's dense weight (and
  bias): how far the module is from the dense projection *on its own input* (what the
  calibrated fit minimises on calibration text);
* ``drift`` — ``|y_s - y_t|^2 / |y_t|^2``: how far the module's output is from the dense
  model's at the same place, the error of every module before it included (what the
  layer-wise distillation minimises).

The teacher must have the student's layout (:func:`structlm.convert.distill.dense_teacher`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from structlm.convert.permute import _weight
from structlm.convert.typed_linear import TypedAlgebraLinear
from structlm.hf.hooks import StopForward, hooked, run_until_stopped

__all__ = ["module_errors"]


@torch.no_grad()
def module_errors(student: nn.Module, teacher: nn.Module, ids: torch.Tensor,
                  batch_size: int = 4) -> dict[str, dict[str, Any]]:
    """Per converted module of ``student``: ``local`` and ``drift`` relative errors (module
    docstring) in total and per position type (a list of ``q``), over the windows ``ids``
    ``(n, T)`` (positions ``0..T-1``)."""
    conv = getattr(student, "_structlm_conversion", None)
    if conv is None:
        raise ValueError("the student is not converted (no convert_ record)")
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"ids must be non-empty windows (n, T), got shape {tuple(ids.shape)}")
    schedule = conv.config.type_schedule()
    names = list(conv.names)
    s_mods = [student.get_submodule(n) for n in names]
    t_mods = [teacher.get_submodule(n) for n in names]
    if not all(isinstance(m, TypedAlgebraLinear) for m in s_mods):
        raise ValueError("every recorded module of the student must be converted")
    q = s_mods[0].q
    sums = {n: torch.zeros(4, q, dtype=torch.float64) for n in names}  # num/den x local/drift
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    t_out: dict[str, torch.Tensor] = {}
    s_name = {id(m): n for m, n in zip(s_mods, names, strict=True)}
    t_name = {id(m): n for m, n in zip(t_mods, names, strict=True)}

    def s_hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        seen[s_name[id(module)]] = (args[0].detach(), out.detach())
        if len(seen) == len(names):
            raise StopForward  # the LM head and later layers are not needed

    def t_hook(module: nn.Module, _args: tuple, out: torch.Tensor) -> None:
        t_out[t_name[id(module)]] = out.detach()
        if len(t_out) == len(names):
            raise StopForward

    student.eval()
    teacher.eval()
    for start in range(0, ids.shape[0], batch_size):
        batch = ids[start:start + batch_size]
        seen.clear()
        t_out.clear()
        with hooked(s_mods, s_hook, pre=False):
            run_until_stopped(student, input_ids=batch, use_cache=False)
        with hooked(t_mods, t_hook, pre=False):
            run_until_stopped(teacher, input_ids=batch, use_cache=False)
        pos = torch.arange(batch.shape[1]).expand(batch.shape[0], -1)
        for name, sm, tm in zip(names, s_mods, t_mods, strict=True):
            x, y = seen[name]
            conv1d = type(tm).__name__ == "Conv1D"  # GPT-2 stores (in, out)
            dense = F.linear(x, _weight(tm, conv1d), getattr(tm, "bias", None))
            types = schedule.at_layer(sm.layer_index)(pos).reshape(-1)
            d = dense.reshape(-1, dense.shape[-1]).double()
            ys = y.reshape(-1, y.shape[-1]).double()
            yt = t_out[name].reshape(-1, y.shape[-1]).double()
            rows = torch.stack([((ys - d) ** 2).sum(1), (d ** 2).sum(1),
                                ((ys - yt) ** 2).sum(1), (yt ** 2).sum(1)])  # (4, rows)
            sums[name].index_add_(1, types, rows)
    out: dict[str, dict[str, Any]] = {}
    for name, s in sums.items():
        total = s.sum(1)
        out[name] = {
            "local": float(total[0] / total[1].clamp_min(1e-300)),
            "drift": float(total[2] / total[3].clamp_min(1e-300)),
            "local_per_type": (s[0] / s[1].clamp_min(1e-300)).tolist(),
            "drift_per_type": (s[2] / s[3].clamp_min(1e-300)).tolist()}
    return out

