"""Forward hooks that may end a forward early: what the calibrated conversion,
distillation and the permutation statistics (:mod:`structlm.convert`) and SVD-LLM's
layer-wise update (:mod:`structlm.share.compress.methods.svd_llm`) use to see a few
modules' inputs or outputs without running the rest of the model."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["StopForward", "hooked", "run_until_stopped"]


class StopForward(Exception):
    """Raised by a hook once it has seen what it needs: :func:`run_until_stopped` ends
    the forward there."""


@contextmanager
def hooked(modules: Iterable[nn.Module], hook: Callable[..., Any], pre: bool = True,
           with_kwargs: bool = False) -> Iterator[None]:
    """``hook`` registered on every module (a forward pre-hook, or a forward hook with
    ``pre=False``) for the block, removed afterwards whatever happens."""
    if pre:
        handles = [m.register_forward_pre_hook(hook, with_kwargs=with_kwargs)
                   for m in modules]
    else:
        handles = [m.register_forward_hook(hook, with_kwargs=with_kwargs) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def run_until_stopped(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``; ``None`` if a hook ended it with :class:`StopForward`."""
    try:
        return call(*args, **kwargs)
    except StopForward:
        return None
