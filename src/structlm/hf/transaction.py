"""Changes to a model's module structure that are undone on any error.

:func:`restore_on_error` records, for every module of a model, which child modules,
parameters and buffers it holds (references only: no tensor is copied) and, when the
block raises, puts every one of them back — a function that replaces modules in place
(``compress_model``) then leaves the model exactly as it was. What it cannot undo, and so
what a function inside it must not do, is write into an existing tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

__all__ = ["restore_on_error"]


@contextmanager
def restore_on_error(model: nn.Module) -> Iterator[None]:
    """Undo every module, parameter and buffer replacement made in the block if it raises
    (any exception, ``KeyboardInterrupt`` too); re-raises it."""
    saved = [(m, dict(m._modules), dict(m._parameters), dict(m._buffers))
             for m in model.modules()]
    try:
        yield
    except BaseException:
        for module, children, params, buffers in saved:
            module._modules.clear()
            module._modules.update(children)
            module._parameters.clear()
            module._parameters.update(params)
            module._buffers.clear()
            module._buffers.update(buffers)
        raise
