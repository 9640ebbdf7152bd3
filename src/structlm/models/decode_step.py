"""The CPU decode accelerator of a StructLM model: a cached decode step with one compiled
call for every decoder block.

For one new token per sequence, a block's PyTorch forward is ~25 small ops (layer
norms, the fused projections, views, the cache append, SDPA, residual adds); on the
``paper-110m`` model at batch 1 they cost ~9 ms of a ~40 ms step on 2 cores, the same
for the dense and the algebra model. :meth:`DecodeAccelerator.step` runs every block
in one call of :func:`structlm.nn.fused.decode_stack` instead: layer norms, attention
over the cache (the new key and value written into
:class:`~structlm.models.kv_cache.GrowingKVLayer`'s spare capacity) and the same
few-row kernel for every projection, the FFN dense or algebra. The dense and the
algebra model take this path alike, so a throughput comparison still measures only
the FFN's structure.

Whether a step takes it is the route's decision
(:class:`~structlm.ops.route.DecodeStepCall`): unpadded decode steps of at most
``decode_max_rows`` sequences, CPU float32/float64, no autograd, a cache of
``GrowingKVLayer`` (what ``generate`` uses), and only while every block is exactly
what the kernel re-implements (``StructLMBlock.kernel_tensors``). A block whose
matrices were replaced (``structlm.hf.adapters``: a ``ConcatProjection`` qkv, a
factorised output projection, a ``GatedMLP``) sends the model to the modules'
forward; the tests compare the two.

The model holds one :class:`DecodeAccelerator` (its one hook point); it caches each
block's tensors in a plan keyed on the structure epoch
(:func:`~structlm.nn.structure_epoch`), the dtype and the route's overrides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from structlm.models.kv_cache import GrowingKVLayer
from structlm.nn.fused import decode_stack, ffn_kernel_args, typed_decode
from structlm.nn.structure import structure_epoch
from structlm.ops.plan import BlockPlan
from structlm.ops.route import DecodeStepCall, Route, choose, override_state, untraced

__all__ = ["BlockTensors", "DecodeAccelerator"]


@dataclass
class BlockTensors:
    """One block's tensors as the decode stack takes them."""

    dense: list[torch.Tensor]  # ln_1 w, b, qkv w, b, proj w, b, ln_2 w, b
    ffn: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate, up, down weights
    plans: tuple[BlockPlan, BlockPlan] | None  # (gate/up plan, down plan); None: dense
    eps: float


@dataclass
class _Plan:
    """Every block's tensors, gathered once (walking the modules on every step cost
    ~1.4 ms of a ~35 ms ``paper-110m`` step: the weight stream has evicted the Python
    objects from the caches). It holds the parameters themselves, so in-place updates,
    ``.data`` swaps and ``.to()`` are seen by the kernel."""

    key: tuple[Any, ...]
    blocks: list[BlockTensors] | None  # None: some block is not what the kernel computes
    #: typed? -> (the FFN weights' states, their kernel arguments per block)
    ffn_args: dict[bool, tuple[list[tuple[int, int]], list[list[torch.Tensor]]]] = field(
        default_factory=dict)

    def kernel_ffn_args(self, typed: bool) -> list[list[torch.Tensor]]:
        """Every block's :func:`~structlm.nn.fused.ffn_kernel_args`, rebuilt when an FFN
        weight was updated in place or its data swapped (a dict lookup per weight per step
        cost ~0.3 ms of a step)."""
        assert self.blocks is not None
        state = [(w._version, w.data_ptr()) for b in self.blocks for w in b.ffn]
        cached = self.ffn_args.get(typed)
        if cached is None or cached[0] != state:
            cached = (state, [ffn_kernel_args(*b.ffn, b.plans, typed) for b in self.blocks])
            self.ffn_args[typed] = cached
        return cached[1]


class DecodeAccelerator:
    """The CPU decode accelerator of one StructLM model (see the module docstring)."""

    def __init__(self) -> None:
        self._plan: _Plan | None = None

    def __getstate__(self) -> dict[str, Any]:
        """No plan in a copy or a pickle (it holds the original's parameters)."""
        return {"_plan": None}

    def step(self, model: Any, x: torch.Tensor, mask: torch.Tensor | None,
             position_ids: torch.Tensor, cache: Any) -> torch.Tensor | None:
        """All decoder blocks of ``model`` (a ``StructLMModel``) for ``x (B, 1, D)``
        (embeddings incl. positions) in one compiled call, the new keys and values
        appended to ``cache``: ``(B, 1, D)`` before the final layer norm. ``None`` where
        the route does not choose the decode stack (the caller runs the blocks)."""
        if self._decision(model, x, mask, cache).route is not Route.DECODE_STACK:
            return None
        return self._run(model, x, position_ids, cache)

    def decision(self, model: Any, x: torch.Tensor, mask: torch.Tensor | None,
                 cache: Any) -> Route:
        """The route a forward of ``x`` with ``mask`` and ``cache`` takes (for tests)."""
        return self._decision(model, x, mask, cache).route

    def _decision(self, model: Any, x: torch.Tensor, mask: torch.Tensor | None,
                  cache: Any) -> Any:
        one_token = x.dim() == 3 and x.shape[1] == 1
        call = DecodeStepCall(
            x, padded=mask is not None,
            cache_ready=one_token and _cache_ready(cache, len(model.h)),
            layerwise=model.score_groups is not None or (
                model.schedule is not None and model.schedule.depends_on_layer),
            trained=torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters()),
            blocks_ready=one_token and self._current_plan(model, x).blocks is not None)
        return choose(call)

    def _current_plan(self, model: Any, x: torch.Tensor) -> _Plan:
        key = (structure_epoch(), x.dtype, override_state())
        plan = self._plan
        if plan is None or plan.key != key:
            n_head = model.config.num_attention_heads
            q = None if model.schedule is None else model.q
            with untraced():  # asks the route about representative calls, not real ones
                blocks = [b.kernel_tensors(x, n_head, q) if hasattr(b, "kernel_tensors")
                          else None for b in model.h]
            plan = _Plan(key, None if any(b is None for b in blocks) else blocks)
            self._plan = plan
        return plan

    def _run(self, model: Any, x: torch.Tensor, position_ids: torch.Tensor,
             cache: Any) -> torch.Tensor:
        b, _, d = x.shape
        n_head = model.config.num_attention_heads
        if model.schedule is None:
            types, q, typed = torch.zeros(b, dtype=torch.int64), 1, True
        else:  # typed copies need one type for all rows (equal positions, the usual case)
            types, q = model.schedule(position_ids).reshape(-1).to(torch.int64), model.q
            typed = typed_decode(types)
        plan = self._current_plan(model, x)
        assert plan.blocks is not None
        like = x.new_empty((b, n_head, 1, d // n_head))  # the shape of one step's keys
        layers = cache.layers
        bufs = [layer.reserve(like, like) for layer in layers]  # (B, nh, capacity, hs) x2, n
        past = bufs[0][2]
        if any(n != past for _, _, n in bufs):
            raise ValueError(f"the cache's layers hold different lengths "
                             f"{[n for *_, n in bufs]}")
        h, keys, values = decode_stack(
            x.reshape(b, d), [blk.dense for blk in plan.blocks],
            [blk.eps for blk in plan.blocks], [k for k, _, _ in bufs],
            [v for _, v, _ in bufs], past, plan.kernel_ffn_args(typed), types, q,
            typed)  # (B, D)
        for layer, k, v in zip(layers, keys, values, strict=True):
            layer.commit_views(k, v)  # (B, nh, past + 1, hs)
        return h.view(b, 1, d)


def _cache_ready(cache: Any, n_layers: int) -> bool:
    """A filled cache whose layers are all in-place :class:`GrowingKVLayer` s."""
    layers = getattr(cache, "layers", None) if cache is not None else None
    return (isinstance(layers, list) and len(layers) == n_layers
            and all(type(layer) is GrowingKVLayer and layer.is_initialized for layer in layers)
            and layers[0].get_seq_length() > 0)  # every layer's length: checked on use
