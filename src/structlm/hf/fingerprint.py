"""Content fingerprints for cache keys: a model's weights, a tensor of token ids.

Caches are keyed on what they were computed from, never on a path or a name: a model
retrained at the same path, or text edited under the same file names, gets new keys.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

__all__ = ["model_fingerprint", "tensor_fingerprint"]


def _update(h: hashlib._Hash, t: torch.Tensor) -> None:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():  # flat first: a 0-dim tensor cannot be viewed as bytes
        h.update(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


def tensor_fingerprint(t: torch.Tensor) -> str:
    """A hex digest of ``t``'s dtype, shape and bytes."""
    h = hashlib.blake2b(digest_size=16)
    _update(h, t)
    return h.hexdigest()


def model_fingerprint(model: nn.Module) -> str:
    """A hex digest of every parameter and buffer of ``model`` (names, dtypes, shapes and
    bytes; a tensor shared under several names counted once), plus its class: about a
    second for SmolLM2-135M's 540 MB."""
    h = hashlib.blake2b(digest_size=16)
    h.update(type(model).__name__.encode())
    seen: set[tuple[int, int]] = set()
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        key = (t.data_ptr(), t.numel())
        h.update(name.encode())
        if key in seen and t.numel():
            h.update(b"=shared")
            continue
        seen.add(key)
        _update(h, t)
    return h.hexdigest()
