"""Layer-wise distillation of a converted model toward the dense model it came from.

Before language-model healing, the converted projections can be trained to reproduce
the dense projections' outputs: on each batch the dense model (the teacher) runs once
without gradients and every converted module's output is compared with the teacher's
output of the module with the same name. The loss is the mean over modules of the
relative squared error ``|s - t|^2 / |t|^2`` (so every module counts alike, whatever its
output scale). The student runs on its own activations (what it will see when used),
the targets are the teacher's on the teacher's activations; both forwards stop after
the last compared module (the LM head and later layers are not run).

Use it as the ``objective`` of :func:`structlm.hf.finetune.finetune`, with the
converted modules' parameters as ``params``. The teacher must compute the same
function as the model did before conversion *with the same module layout*: copy it
after any permutation (:func:`structlm.convert.permute.permute_ffn_`) and before
``convert_``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from structlm.hf.hooks import StopForward, hooked, run_until_stopped

__all__ = ["ModuleDistillation", "dense_teacher"]


class ModuleDistillation:
    """The distillation objective ``(model, batch) -> loss`` for the modules ``names``.

    Args:
        teacher: the dense model (frozen and put in eval mode here).
        names: fully qualified names of the compared modules, present in the teacher and
            in every model the objective is called with.

    Raises:
        ValueError: no names, or a name the teacher lacks.
    """

    def __init__(self, teacher: nn.Module, names: Sequence[str]) -> None:
        if not names:
            raise ValueError("no modules to distil")
        missing = [n for n in names if not _has(teacher, n)]
        if missing:
            raise ValueError(f"the teacher has no modules {missing[:3]}")
        self.teacher = teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        self.names = list(names)

    def _outputs(self, model: nn.Module, batch: torch.Tensor) -> list[torch.Tensor]:
        """The outputs of ``names`` in ``model`` on ``batch`` (the forward stops after the
        last of them)."""
        outs: dict[str, torch.Tensor] = {}
        name_of = {id(model.get_submodule(n)): n for n in self.names}

        def hook(module: nn.Module, _args: Any, out: torch.Tensor) -> None:
            outs[name_of[id(module)]] = out
            if len(outs) == len(self.names):
                raise StopForward

        modules = [model.get_submodule(n) for n in self.names]
        with hooked(modules, hook, pre=False):
            run_until_stopped(model, input_ids=batch, use_cache=False)
        if len(outs) != len(self.names):
            raise RuntimeError(f"modules {[n for n in self.names if n not in outs][:3]} did "
                               "not run in the forward")
        return [outs[n] for n in self.names]

    def __call__(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        """Mean over the modules of ``|s - t|^2 / |t|^2`` on ``batch`` ``(B, T)``."""
        with torch.no_grad():
            targets = self._outputs(self.teacher, batch)
        outputs = self._outputs(model, batch)
        losses = [((s.float() - t.float()) ** 2).sum() / (t.float() ** 2).sum().clamp_min(1e-30)
                  for s, t in zip(outputs, targets, strict=True)]
        return torch.stack(losses).mean()


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def dense_teacher(original: nn.Module, converted: nn.Module) -> nn.Module:
    """A copy of the dense ``original`` in the module layout of ``converted`` (a
    :func:`~structlm.convert.convert_`-ed copy of it): the permutations the conversion
    chose (:mod:`structlm.convert.permute`) applied, so every compared module computes
    what the student's module computed before its product changed."""
    from structlm.convert.heads import apply_head_orders_
    from structlm.convert.permute import apply_ffn_orders_

    conv = getattr(converted, "_structlm_conversion", None)
    if conv is None:
        raise ValueError("the student is not converted (no convert_ record)")
    teacher = copy.deepcopy(original)
    if conv.unit_orders:
        apply_ffn_orders_(teacher, conv.unit_orders)
    if conv.head_orders:
        apply_head_orders_(teacher, conv.head_orders)
    return teacher
