"""When a model's module structure changes: the key of every decision cached from it.

A fast path may cache what it derived from a model's modules (the StructLM decode
plan, an FFN's kernel kind) only under :func:`structure_epoch`, which changes whenever
that structure may have changed:

* a module of structlm's own (:class:`StructureTracked`: the algebra and decode
  layers, every StructLM block, attention, MLP and norm) gets a submodule or a parameter
  assigned — ``block.mlp.gate = nn.Linear(...)``, ``layer.weight = nn.Parameter(...)``;
* a model's modules are replaced through structlm (the adapters' ``replace``,
  ``convert_`` / ``unconvert_``) or a state dict is loaded into a StructLM model: these
  call :func:`invalidate_fast_paths`;
* anything else that swaps modules by hand calls :func:`invalidate_fast_paths` too.

In-place updates and ``.data`` swaps of a parameter need nothing: the caches hold the
parameter objects and re-check their version and data pointer. An in-place write
*through* ``.data`` (``w.data.mul_(2)``) bumps no version and is not seen by the CPU
kernels' weight copies: write through the parameter under ``torch.no_grad()`` instead
(``w.mul_(2)``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["EPOCH", "StructureTracked", "invalidate_fast_paths", "keep_bound_call",
           "structure_epoch"]

_EPOCH = [0]
#: the epoch as a one-element list, for hot paths that read it without a call
EPOCH = _EPOCH


def structure_epoch() -> int:
    """A number that changes whenever a cached decision may be stale (module docstring)."""
    return _EPOCH[0]


def invalidate_fast_paths(module: nn.Module | None = None) -> None:
    """Declare that ``module``'s structure changed (modules or parameters replaced): every
    decision cached from any model is rebuilt on its next use. ``module`` is accepted for
    readability at the call site; the invalidation is global (cheap: a rebuild costs one
    walk over a model's blocks)."""
    del module
    _EPOCH[0] += 1



def keep_bound_call(module: nn.Module, binding: object) -> None:
    """Keep ``(binding, weight, bias, epoch)`` in ``module.__dict__["_bound_call"]`` for the
    layer's fast path, which checks the parameters by identity against
    ``module._parameters`` and the epoch, so reads no attribute through ``nn.Module``. A
    computed weight (pruning, a parametrization) is not the registered parameter: then no
    call is kept and every call takes the general path."""
    d, weight, bias = module.__dict__, module.weight, module.bias
    if module._parameters.get("weight") is not weight:
        d.pop("_bound_call", None)
        return
    old = d.get("_bound_call")
    if (old is None or old[0] is not binding or old[1] is not weight or old[2] is not bias
            or old[3] != _EPOCH[0]):
        d["_bound_call"] = (binding, weight, bias, _EPOCH[0])

class StructureTracked:
    """Mixin for ``nn.Module`` s: assigning a submodule or a parameter (or ``None`` in
    their place) changes :func:`structure_epoch`."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, nn.Module | nn.Parameter) or (
                (value is None and name in self.__dict__.get("_modules", ()))
                or (value is None and name in self.__dict__.get("_parameters", ()))):
            _EPOCH[0] += 1
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__.get("_modules", ()) or name in self.__dict__.get(
                "_parameters", ()):
            _EPOCH[0] += 1
        super().__delattr__(name)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        _EPOCH[0] += 1
        super().register_parameter(name, param)  # type: ignore[misc]

    def add_module(self, name: str, module: nn.Module | None) -> None:
        _EPOCH[0] += 1
        super().add_module(name, module)  # type: ignore[misc]
