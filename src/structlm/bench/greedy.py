"""The benchmarks' greedy loop on any Hugging Face causal LM: one prefill with the KV
cache, then single-token cached decode steps."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from structlm.hf.decode import output_cache

__all__ = ["decode_steps", "greedy_decode", "prefill"]


def _step_kwargs(model: Any) -> tuple[dict[str, Any], str]:
    """A cached step's keyword arguments and cache argument (``cache`` or ``past_key_values``)."""
    sig = inspect.signature(model.forward).parameters
    kw = {"use_cache": True, **({"logits_to_keep": 1} if "logits_to_keep" in sig else {})}
    return kw, "cache" if "cache" in sig else "past_key_values"


def prefill(model: Any, ids: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """One forward of ``ids`` ``(B, T)``: the filled cache and the greedy next ids ``(B,)``."""
    out = model(input_ids=ids, **_step_kwargs(model)[0])
    return output_cache(out), out.logits[:, -1].argmax(-1)  # logits (B, 1, V)


def decode_steps(model: Any, cache: Any, token: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` greedy single-token forwards with ``cache``, starting from ``token``
    ``(B,)``; returns the ids produced ``(B, steps)``."""
    (kw, name), out = _step_kwargs(model), []
    for _ in range(steps):
        res = model(input_ids=token[:, None], **{name: cache}, **kw)  # (B, 1) in
        cache, token = output_cache(res), res.logits[:, -1].argmax(-1)  # (B,)
        out.append(token)
    return torch.stack(out, 1)


@torch.no_grad()
def greedy_decode(model: Any, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The new ids ``(B, 1 + steps)`` of the benchmark's loop: prefill then ``steps``
    cached decode steps (equal to ``generate(do_sample=False)`` without EOS stopping)."""
    cache, token = prefill(model, ids)
    return torch.cat([token[:, None], decode_steps(model, cache, token, steps)], 1)
