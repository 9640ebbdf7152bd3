"""A cached CPU decode step with one compiled call per decoder block.

For one new token per sequence, a block's PyTorch forward is ~25 small ops (layer
norms, the fused projections, views, the cache append, SDPA, residual adds); on the
``paper-110m`` model at batch 1 they cost ~9 ms of a ~40 ms step on 2 cores, the same
for the dense and the algebra model. :func:`fused_decode_blocks` runs each block as
one call of :func:`decode_stack` instead: layer norms,
attention over the cache (the new key and value written into
:class:`~structlm.models.kv_cache.GrowingKVLayer`'s spare capacity) and the same
few-row kernel for every projection, the FFN dense or algebra. The dense and the
algebra model take this path alike, so a throughput comparison still measures only
the FFN's structure.

It applies to unpadded decode steps (the attention mask is ``None``) of at most
``FUSED_ROWS_MAX_ROWS`` sequences, CPU float32/float64, no autograd, a cache of
``GrowingKVLayer`` (what :meth:`generate` uses), and only while every block still has
the modules the kernel re-implements (:func:`_block_ready`, the one gate): layer norms,
an ``nn.Linear`` qkv and output projection with biases and the expected shapes, and the
SwiGLU MLP with bias-free ``nn.Linear`` or ``AlgebraLinear`` projections. A block whose
matrices were replaced (``structlm.hf.adapters``: a ``ConcatProjection`` qkv, a
factorised output projection, a ``GatedMLP``) sends the whole model to the modules'
forward, like everything else the kernel does not cover; the tests compare the two.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from structlm.models.kv_cache import GrowingKVLayer
from structlm.nn import AlgebraLinear
from structlm.ops import cpu_kernels
from structlm.ops.blocked import FUSED_ROWS_MAX_ROWS, forced_layout

if TYPE_CHECKING:
    from structlm.models.modeling_structlm import StructLMBlock, StructLMModel

__all__ = ["decode_stack", "fused_decode_applies", "fused_decode_blocks",
           "registration_stamp"]

#: bumped whenever any module anywhere registers a parameter or a submodule (torch's
#: global registration hooks); a cached :class:`_DecodePlan` is then rebuilt
_REGISTRATIONS = [0]
_HOOKS_INSTALLED: list[bool] = []


def _registered(*_: Any) -> None:
    _REGISTRATIONS[0] += 1


def registration_stamp() -> int:
    """Changes whenever any module registers a parameter or a submodule: a key for
    anything derived from a model's module structure (also ``StructLMMLP``'s kernel kind).

    Why torch-wide hooks: the alternative, re-reading every module and parameter the
    decode step uses on every step, cost ~1.4 ms of a ~35 ms ``paper-110m`` CPU step
    (the weight stream evicts those Python objects from the caches), while a replaced
    module or parameter must never be missed (a stale plan would run the old weights).
    The two hooks only bump a counter, and are installed on the first call, i.e. the
    first time a StructLM model asks for a decode plan or its FFN's kernel kind, not
    when ``structlm`` is imported; anything registered before that cannot be stale,
    since no plan existed."""
    if not _HOOKS_INSTALLED:
        register_module_parameter_registration_hook(_registered)
        register_module_module_registration_hook(_registered)
        _HOOKS_INSTALLED.append(True)
    return _REGISTRATIONS[0]


def decode_stack(x: torch.Tensor, dense: list[list[torch.Tensor]], eps: list[float],
                 k_bufs: list[torch.Tensor], v_bufs: list[torch.Tensor], past: int,
                 ffn: list[list[torch.Tensor]], types: torch.Tensor, q: int, typed: bool
                 ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """``(M, D) -> (M, D)``: every pre-norm decoder block (``x + attn(ln_1(x))``, then
    ``+ ffn(ln_2(.))``) for one new token per sequence in one call of the compiled kernel
    (``ops/csrc/decode_block.cpp``; CPU, no autograd). This module owns the decoder's
    binding; ``ops`` only builds the kernel.

    Per block (the lists hold one entry each): ``dense`` = ln_1 weight and bias, qkv
    weight and bias, proj weight and bias, ln_2 weight and bias; the new key and value
    are written at position ``past`` of the caches ``k_bufs``/``v_bufs``
    ``(M, n_head, capacity, hs)`` and attention covers positions ``0 .. past`` (no
    padding); ``ffn`` is :func:`~structlm.ops.cpu_kernels.ffn_kernel_args`; ``types
    (M,)`` int64 and ``q`` the FFN's types (1: dense). Returns the output ``(M, D)`` and
    each block's keys and values over positions ``0 .. past`` (views of the caches,
    ``(M, n_head, past + 1, hs)``)."""
    mod = cpu_kernels.kernel_for(x, dense[0][2] if dense else x)
    out = mod.decode_stack_forward(x, dense, eps, k_bufs, v_bufs, past, ffn, types, q, typed)
    return out[0], out[1::2], out[2::2]


@dataclass
class _DecodePlan:
    """Each block's kernel arguments, gathered once per model (walking the modules on
    every step cost ~1.4 ms of a ~35 ms ``paper-110m`` step: the weight stream has
    evicted the Python objects from the caches).

    It holds the parameters themselves, so in-place updates, ``.data`` swaps and
    ``.to()`` are seen by the kernel; it goes stale when a parameter or module is
    replaced (``_REGISTRATIONS``; a share adapter's ``replace`` too), the dtype or the
    forced layout changes, or an algebra layer's backend is set: all checked by
    :func:`_decode_plan`, which asks :func:`_block_ready` again then. The panel-packed
    copies of algebra weights are looked up on every step
    (:func:`~structlm.ops.cpu_kernels.packed_weight` redoes one after an in-place update).
    """

    key: tuple[Any, ...]
    ready: bool  # every block can run on the kernel (else nothing below is gathered)
    dense: list[list[torch.Tensor]]  # per block: ln_1 w, b, qkv w, b, proj w, b, ln_2 w, b
    ffn: list[tuple[torch.Tensor, ...]]  # per block: gate, up, down weights
    plans: list[Any]  # per block: (gate/up plan, down plan), or None for a dense FFN
    eps: list[float]
    backends: list[tuple[AlgebraLinear, Any]] = field(default_factory=list)
    #: typed? -> (the FFN weights' states, their kernel arguments per block)
    ffn_args: dict[bool, tuple[list[tuple[int, int]], list[list[torch.Tensor]]]] = field(
        default_factory=dict)

    def kernel_ffn_args(self, typed: bool) -> list[list[torch.Tensor]]:
        """Every block's :func:`~structlm.ops.cpu_kernels.ffn_kernel_args`, rebuilt when
        an FFN weight was updated in place or its data swapped (a dict lookup per weight
        per step cost ~0.3 ms of a step)."""
        state = [(w._version, w.data_ptr()) for ws in self.ffn for w in ws]
        cached = self.ffn_args.get(typed)
        if cached is None or cached[0] != state:
            cached = (state, [cpu_kernels.ffn_kernel_args(*ws, plans, typed)
                              for ws, plans in zip(self.ffn, self.plans, strict=True)])
            self.ffn_args[typed] = cached
        return cached[1]


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _decode_plan(model: StructLMModel, x: torch.Tensor) -> _DecodePlan:
    key = (registration_stamp(), x.dtype, forced_layout())
    plan = _PLANS.get(model)
    if plan is not None and plan.key == key and all(
            layer.backend is backend for layer, backend in plan.backends):
        return plan
    blocks = list(model.h)
    backends = [(m, m.backend) for b in blocks for m in b.modules()
                if isinstance(m, AlgebraLinear)]
    if not all(_block_ready(b, model, x) for b in blocks):  # cached too: one check per rebuild
        plan = _DecodePlan(key=key, ready=False, dense=[], ffn=[], plans=[], eps=[],
                           backends=backends)
    else:
        plan = _DecodePlan(
            key=key, ready=True,
            dense=[[b.ln_1.weight, b.ln_1.bias, b.attn.qkv.weight, b.attn.qkv.bias,
                    b.attn.proj.weight, b.attn.proj.bias, b.ln_2.weight, b.ln_2.bias]
                   for b in blocks],
            ffn=[(b.mlp.gate.weight, b.mlp.up.weight, b.mlp.down.weight) for b in blocks],
            plans=[(b.mlp.gate.plan, b.mlp.down.plan)
                   if b.mlp.kernel_kind() == "algebra" else None for b in blocks],
            eps=[float(b.ln_1.eps) for b in blocks], backends=backends)
    _PLANS[model] = plan
    return plan


def _block_ready(block: StructLMBlock, model: StructLMModel, x: torch.Tensor) -> bool:
    """The one gate of the fused step: whether ``block`` consists of exactly the modules
    :func:`decode_stack` re-implements, with the expected
    shapes, and its parameters suit the kernel for inputs like ``x``.

    That is a ``StructLMBlock`` with ``nn.LayerNorm`` s (affine, with bias, one eps),
    the ``StructLMAttention`` with ``nn.Linear`` (or ``DecodeLinear``) qkv ``(3D, D)``
    and proj ``(D, D)``, both with bias, and the ``StructLMMLP`` whose projections the
    SwiGLU kernel takes (:meth:`~structlm.models.modeling_structlm.StructLMMLP.kernel_kind`:
    bias-free dense layers for a model without position types, algebra layers of the
    model's ``q`` otherwise). Anything else — a replaced matrix (``ConcatProjection``,
    ``LowRankLinear`` ...), a ``GatedMLP``, a bias-free projection — is not what the kernel
    computes, so the modules' forward runs instead. Only called when the plan is rebuilt.
    """
    from structlm.models.modeling_structlm import (
        LINEAR_KINDS,
        StructLMAttention,
        StructLMBlock,
        StructLMMLP,
    )

    if type(block) is not StructLMBlock:
        return False
    d = model.config.hidden_size
    ln1, ln2, attn, mlp = block.ln_1, block.ln_2, block.attn, block.mlp
    if not (type(ln1) is nn.LayerNorm and type(ln2) is nn.LayerNorm
            and ln1.normalized_shape == ln2.normalized_shape == (d,)
            and ln1.elementwise_affine and ln2.elementwise_affine
            and ln1.bias is not None and ln2.bias is not None and ln1.eps == ln2.eps):
        return False
    if not (type(attn) is StructLMAttention
            and attn.n_head == model.config.num_attention_heads and d % attn.n_head == 0):
        return False
    qkv, proj = attn.qkv, attn.proj
    if not (type(qkv) in LINEAR_KINDS and type(proj) in LINEAR_KINDS
            and qkv.weight.shape == (3 * d, d) and qkv.bias is not None
            and qkv.bias.shape == (3 * d,) and proj.weight.shape == (d, d)
            and proj.bias is not None and proj.bias.shape == (d,)):
        return False
    kind = mlp.kernel_kind() if type(mlp) is StructLMMLP else None
    if kind is None or mlp.gate.in_features != d:
        return False
    if (kind == "algebra") != (model.schedule is not None) or (
            kind == "algebra" and mlp.gate.q != model.q):
        return False  # the kernel's row types come from the model's schedule
    params = (ln1.weight, ln1.bias, qkv.weight, qkv.bias, proj.weight, proj.bias,
              ln2.weight, ln2.bias, mlp.gate.weight, mlp.up.weight, mlp.down.weight)
    if not all(p.dtype == x.dtype and p.device.type == "cpu" and p.is_contiguous()
               for p in params):
        return False
    if kind == "algebra":
        return all(layer.kernel_decode_ready(x) for layer in (mlp.gate, mlp.up, mlp.down))
    return True


def fused_decode_applies(model: StructLMModel, x: torch.Tensor, mask: torch.Tensor | None,
                         cache: Any) -> bool:
    """Whether :func:`fused_decode_blocks` can run this forward: ``x (B, 1, D)``
    embeddings of one new token per unpadded sequence, ``B <= FUSED_ROWS_MAX_ROWS``,
    CPU float32/float64 with nothing for autograd to record, and a filled cache whose
    layers are all :class:`GrowingKVLayer`."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False  # the stack kernel writes the caches and returns views: not an op
    if (mask is not None or x.dim() != 3 or x.shape[1] != 1
            or x.shape[0] > FUSED_ROWS_MAX_ROWS or cache is None
            or not cpu_kernels.rows_kernel_applies(x, model.wte.weight)):
        return False
    if torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters()):
        return False
    if model.score_groups is not None or (model.schedule is not None
                                          and model.schedule.depends_on_layer):
        return False  # the fused step computes dense scores and one type for every layer
    layers = getattr(cache, "layers", None)
    if (not isinstance(layers, list) or len(layers) != len(model.h)
            or not all(type(layer) is GrowingKVLayer and layer.is_initialized
                       for layer in layers)
            or layers[0].get_seq_length() == 0):  # every layer's length: checked on use
        return False
    return _decode_plan(model, x).ready


def fused_decode_blocks(model: StructLMModel, x: torch.Tensor, position_ids: torch.Tensor,
                        cache: Any) -> torch.Tensor:
    """All decoder blocks for ``x (B, 1, D)`` (embeddings incl. positions) in one compiled
    call; appends the new keys and values to ``cache``. Returns ``(B, 1, D)``
    before the final layer norm. Check :func:`fused_decode_applies` first."""
    b, _, d = x.shape
    n_head = model.config.num_attention_heads
    if model.schedule is None:
        types, q, typed = torch.zeros(b, dtype=torch.int64), 1, True
    else:  # typed copies need one type for all rows (equal positions, the usual case)
        types, q = model.schedule(position_ids).reshape(-1).to(torch.int64), model.q
        typed = (cpu_kernels.decode_copy_mode() == "typed"
                 and (b == 1 or bool((types == types[0]).all())))
    plan = _decode_plan(model, x)
    like = x.new_empty((b, n_head, 1, d // n_head))  # the shape of one step's keys
    layers = cache.layers
    bufs = [layer.reserve(like, like) for layer in layers]  # (B, nh, capacity, hs) twice, n
    past = bufs[0][2]
    if any(n != past for _, _, n in bufs):
        raise ValueError(f"the cache's layers hold different lengths {[n for *_, n in bufs]}")
    ffn = plan.kernel_ffn_args(typed)
    h, keys, values = decode_stack(
        x.reshape(b, d), plan.dense, plan.eps, [k for k, _, _ in bufs], [v for _, v, _ in bufs],
        past, ffn, types, q, typed)  # (B, D)
    for layer, k, v in zip(layers, keys, values, strict=True):
        layer.commit_views(k, v)  # (B, nh, past + 1, hs)
    return h.view(b, 1, d)
