"""Which path every layer of a model takes for an input shape: :func:`explain_routes`.

It runs a prefill of ``batch`` sequences of ``tokens`` random ids with the KV cache,
then ``decode_steps`` single-token cached steps, under :func:`structlm.ops.route.trace`,
and attributes every decision of the route to the module whose forward made it. Bound
decode calls (which cache a decision) are bypassed while recording, so every call is
decided afresh and shows up.

    >>> rows = explain_routes(model, batch=1, tokens=8)
    >>> print(format_routes(rows))
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from structlm.ops.route import (
    AlgebraCall,
    Decision,
    DecodeStepCall,
    DenseCall,
    FFNCall,
    Route,
    TraceRecord,
    trace,
)

__all__ = ["RouteRecord", "explain_routes", "format_routes"]

_PLAIN = Decision(Route.TORCH, "a plain nn.Linear asks no route: F.linear "
                  "(structlm.hf.decode.use_decode_kernels_ puts it on the few-row kernel)")
_CALL_NAMES = {AlgebraCall: "algebra", DenseCall: "dense", FFNCall: "ffn",
               DecodeStepCall: "decode step"}


@dataclass(frozen=True)
class RouteRecord:
    """One decision: in which phase, by which module, for which call and rows."""

    phase: str
    module: str
    call: str
    rows: int
    route: str
    reason: str


def _rows(call: Any) -> int:
    x = call.x
    return int(x.numel() // x.shape[-1]) if x.dim() else 1


def explain_routes(model: nn.Module, batch: int = 1, tokens: int = 8,
                   decode_steps: int = 1, vocab: int | None = None) -> list[RouteRecord]:
    """The route of every fast-path decision in a prefill of ``(batch, tokens)`` random
    ids and ``decode_steps`` cached decode steps of ``model`` (a causal LM whose forward
    takes ``input_ids`` and ``use_cache``), one record per decision, in call order.

    Raises:
        TypeError: ``model`` is not a Hugging Face causal LM (an ``nn.Module`` with
            ``get_input_embeddings``), e.g. a plain module or a model name.
        ValueError: a non-positive ``batch`` or ``tokens``, a negative ``decode_steps``.
    """
    if not isinstance(model, nn.Module) or not callable(getattr(model, "get_input_embeddings",
                                                                 None)):
        what = repr(model) if isinstance(model, str) else type(model).__name__
        hint = (" (a name: load the model first, e.g. structlm.hf.load_model(name).model)"
                if isinstance(model, str) else "")
        raise TypeError(f"explain_routes expects a Hugging Face causal LM (a model with "
                        f"get_input_embeddings whose forward takes input_ids), got "
                        f"{what}{hint}")
    for name, value in (("batch", batch), ("tokens", tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(decode_steps, bool) or not isinstance(decode_steps, int) or decode_steps < 0:
        raise ValueError(f"decode_steps must be an integer >= 0, got {decode_steps!r}")
    if vocab is None:
        vocab = int(model.get_input_embeddings().weight.shape[0])
    names = {id(m): n or "(model)" for n, m in model.named_modules()}
    stack: list[str] = []
    handles = []

    def enter(mod: nn.Module, _args: Any) -> None:
        stack.append(names.get(id(mod), type(mod).__name__))

    def leave(mod: nn.Module, args: Any, _out: Any) -> None:
        name = stack.pop()
        if type(mod) is nn.Linear and active and args:  # asks no route: F.linear always
            active[-1].append(TraceRecord(DenseCall(args[0], mod.weight), _PLAIN, name))

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave))
    ids = torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(0))
    records: list[RouteRecord] = []
    active: list[list[TraceRecord]] = []
    cache_name = _cache_name(model)
    try:
        with torch.no_grad():
            cache, inputs = None, ids
            for step in range(decode_steps + 1):
                phase = "prefill" if step == 0 else f"decode {step}"
                with trace(lambda: stack[-1] if stack else "") as decisions:
                    active.append(decisions)
                    out = model(input_ids=inputs, use_cache=True,
                                **({} if cache is None else {cache_name: cache}))
                    active.pop()
                records += [RouteRecord(phase, r.context, _CALL_NAMES[type(r.call)],
                                        _rows(r.call), r.decision.route.value,
                                        r.decision.reason) for r in decisions]
                cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
                inputs = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
    finally:
        for h in handles:
            h.remove()
    return records


def _cache_name(model: nn.Module) -> str:
    sig = inspect.signature(model.forward).parameters
    return "cache" if "cache" in sig else "past_key_values"


def format_routes(records: list[RouteRecord], by_layer: bool = False) -> str:
    """A Markdown table of ``records``: by default the layer index in module names is
    replaced by ``*`` and equal decisions within a phase are merged (``xN``: how many
    modules took it); ``by_layer=True`` lists every module."""
    lines = ["| phase | module | call | rows | route | reason |", "|---|---|---|---:|---|---|"]
    merged: dict[RouteRecord, int] = {}
    for r in records:
        if not by_layer:
            r = RouteRecord(r.phase, re.sub(r"\.\d+(?=\.|$)", ".*", r.module), r.call,
                            r.rows, r.route, r.reason)
        merged[r] = merged.get(r, 0) + 1
    for r, n in merged.items():
        times = f" x{n}" if n > 1 else ""
        lines.append(f"| {r.phase} | {r.module}{times} | {r.call} | {r.rows} | {r.route} "
                     f"| {r.reason} |")
    return "\n".join(lines)
