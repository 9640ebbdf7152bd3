"""The one decision of which implementation runs a call: :func:`choose`.

Every forward that can take a fast path describes its call — an algebra product
(:class:`AlgebraCall`: ``AlgebraLinear``), a dense projection (:class:`DenseCall`:
``DecodeLinear``, :func:`~structlm.nn.fast_linear`), a SwiGLU FFN (:class:`FFNCall`:
the StructLM MLP) or a whole decode step (:class:`DecodeStepCall`: the StructLM model)
— and asks :func:`choose`, which returns a :class:`Decision`: a :class:`Route` and the
reason. The row thresholds it uses live in one table, :data:`THRESHOLDS`
(:mod:`.route_table`), each with the measurement that set it; the overrides for tests and debugging
(:func:`force_backend`, :func:`force_layout`, ``STRUCTLM_BACKEND``) are read here and
nowhere else.

A caller may *cache* a decision (a layer's bound decode call, the model's decode plan)
only together with what it depended on: the bound C++ calls re-check the row count,
dtype, device and autograd state on every call and fall back to asking again;
:func:`override_state` is part of every cached key.

:func:`trace` records every decision made inside it (``structlm.hf.routes`` prints
them per module for a model and an input shape).
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import os as _os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from structlm.ops.cpu_extension import extension
from structlm.ops.partition import TypePartition
from structlm.ops.plan import BlockPlan
from structlm.ops.route_table import DISPATCH, THRESHOLDS, Threshold, bucket, load_dispatch
from structlm.settings import (
    backend_override,
    backend_override_probe,
    backend_override_set,
    triton_interpret,
)

__all__ = [
    "KERNEL_DTYPES",
    "THRESHOLDS",
    "AlgebraCall",
    "Backend",
    "Decision",
    "DecodeStepCall",
    "DenseCall",
    "FFNCall",
    "Route",
    "Threshold",
    "TraceRecord",
    "bound_calls_open",
    "choose",
    "dense_bound_calls_open",
    "force_backend",
    "force_layout",
    "forced_layout",
    "gathered_applies",
    "kernel_built",
    "load_dispatch",
    "overridden",
    "override_state",
    "parse_backend",
    "recording",
    "resolve_backend",
    "trace",
    "tracing",
    "triton_route",
    "untraced",
]


class Backend(enum.StrEnum):
    """Implementation family of the algebra product a layer asks for."""

    AUTO = "auto"
    REFERENCE = "reference"
    BLOCKED = "blocked"
    TRITON = "triton"


class Route(enum.StrEnum):
    """The path a call takes."""

    # the algebra product
    REFERENCE = "reference"
    """The masked dense oracle (:mod:`.reference`)."""
    TRITON_DECODE = "triton-decode"
    """Triton, the vector-reduction kernel for a handful of rows."""
    TRITON_FUSED = "triton-fused"
    """Triton, one fused launch over the support."""
    TRITON_TWO_STAGE = "triton-two-stage"
    """Triton, common blocks then per-type blocks (chosen where measured faster)."""
    KERNEL = "fused-rows"
    """The compiled few-row CPU kernel over exactly the rows' blocks."""
    GATHERED = "gathered"
    OUTPUT_MAJOR = "output-major"
    BLOCK_MAJOR = "block-major"
    DIAG_FIRST = "diag-first"
    # a dense projection
    DENSE_KERNEL = "dense-kernel"
    """The compiled few-row kernel, the weight read in place."""
    DENSE_KERNEL_PACKED = "dense-kernel-packed"
    """The compiled few-row kernel on a panel-packed copy of the weight."""
    TORCH = "torch"
    """``F.linear`` (MKL / cuBLAS)."""
    # a SwiGLU FFN, a decode step
    SWIGLU_KERNEL = "swiglu-kernel"
    """The whole FFN in one compiled call."""
    DECODE_STACK = "decode-stack"
    """Every decoder block of a decode step in one compiled call."""
    MODULES = "modules"
    """The modules' own forward (each of them asks again)."""


#: the blocked backend's layouts (:func:`force_layout` takes these names)
LAYOUTS = (Route.KERNEL, Route.GATHERED, Route.OUTPUT_MAJOR, Route.BLOCK_MAJOR,
           Route.DIAG_FIRST)


@dataclass(frozen=True)
class Decision:
    """A route and why it was chosen."""

    route: Route
    reason: str


DECODE_MAX_ROWS = THRESHOLDS["decode_max_rows"].value
_KERNEL_PER_TYPE = THRESHOLDS["kernel_max_rows_per_type"].value
_KERNEL_PORTABLE_PER_TYPE = THRESHOLDS["kernel_portable_max_rows_per_type"].value
_GATHERED_PER_TYPE = THRESHOLDS["gathered_max_rows_per_type"].value
_GATHERED_MIN_Q = THRESHOLDS["gathered_min_q"].value
_OUTPUT_MAJOR_ROWS = THRESHOLDS["output_major_max_rows"].value
_OUTPUT_MAJOR_MIN_ROWS = THRESHOLDS["output_major_min_rows"].value
_OUTPUT_MAJOR_IN_WIDTH = THRESHOLDS["output_major_max_in_width"].value
DENSE_IN_PLACE_MAX_ROWS = THRESHOLDS["dense_in_place_max_rows"].value
DENSE_KERNEL_MAX_ROWS = THRESHOLDS["dense_kernel_max_rows"].value
_TRITON_DECODE_ROWS = THRESHOLDS["triton_decode_max_rows"].value

#: dtypes the compiled CPU kernels are built for
KERNEL_DTYPES = (torch.float32, torch.float64)

# ------------------------------------------------------------------ overrides
_FORCED_BACKEND: list[Backend] = []
_FORCED_LAYOUT: list[Route] = []
_TRACE: list[tuple[list[TraceRecord], Callable[[], Any] | None]] = []
_TRITON_STATE: dict[str, bool] = {}
def parse_backend(name: str | Backend) -> Backend:
    """A :class:`Backend` from its name, with a clear error for an unknown one."""
    try:
        return Backend(name.value if isinstance(name, Backend) else str(name).lower())
    except ValueError:
        choices = ", ".join(b.value for b in Backend)
        raise ValueError(f"unknown backend {name!r}: expected one of {choices}") from None


@contextlib.contextmanager
def force_backend(name: str | Backend) -> Iterator[None]:
    """Within the block, layers built with ``backend="auto"`` use ``name``."""
    _FORCED_BACKEND.append(parse_backend(name))
    try:
        yield
    finally:
        _FORCED_BACKEND.pop()


@contextlib.contextmanager
def force_layout(name: str | Route) -> Iterator[None]:
    """Within the block, the blocked backend uses layout ``name`` wherever it applies
    (tests run every layout on every plan)."""
    if name not in {r.value for r in LAYOUTS}:
        raise ValueError(f"unknown layout {name!r}: expected one of "
                         f"{sorted(r.value for r in LAYOUTS)}")
    _FORCED_LAYOUT.append(Route(name))
    try:
        yield
    finally:
        _FORCED_LAYOUT.pop()


def forced_layout() -> Route | None:
    """The layout :func:`force_layout` forces now, if any."""
    return _FORCED_LAYOUT[-1] if _FORCED_LAYOUT else None


def override_state() -> tuple[Any, ...]:
    """What the overrides are now (forced backend and layout, ``STRUCTLM_BACKEND``): part
    of the key of every cached decision."""
    return (_FORCED_BACKEND[-1] if _FORCED_BACKEND else None,
            _FORCED_LAYOUT[-1] if _FORCED_LAYOUT else None, backend_override())


def overridden() -> bool:
    """Whether any override is in force (a forced backend or layout, ``STRUCTLM_BACKEND``):
    the cheap check of the bound calls, which cache a decision made without one."""
    return bool(_FORCED_BACKEND or _FORCED_LAYOUT) or backend_override_set()


def tracing() -> bool:
    """Whether ``torch.compile`` or ``torch.jit`` is tracing now (kernels are then called
    as registered ops, and no bound call or fused decode step is used)."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


#: what the bound calls' gate reads, bound once: each module attribute lookup on the way
#: costs a cache miss on a decode step (the same function objects, so ``torch.compile``
#: still folds ``is_compiling`` to True while it traces, before ``_is_tracing`` is read)
_ENVIRON, _ENV, _BACKEND_KEY = backend_override_probe()
_is_compiling = torch.compiler.is_compiling
_is_tracing = torch._C._is_tracing


def bound_calls_open() -> bool:
    """Whether a layer's bound decode call may stand for the route now: no override
    (:func:`overridden`), no :func:`trace` recording, no ``torch.compile`` / ``torch.jit``
    tracing. The one check a bound call makes in Python, written flat: on a decode step
    the check runs with cold caches (the weights streamed since), where every Python
    frame and module attribute costs microseconds (this one: ~17 µs on an EPYC VM after a
    128 MiB read, from 23 µs with a frame per condition)."""
    return not (_FORCED_BACKEND or _FORCED_LAYOUT or _TRACE
                or (_BACKEND_KEY in _ENV if _os.environ is _ENVIRON else backend_override_set())
                or _is_compiling() or _is_tracing())


def dense_bound_calls_open() -> bool:
    """:func:`bound_calls_open` for a dense layer's bound call, which no backend or layout
    override concerns: no :func:`trace` recording, no ``torch.compile`` / ``torch.jit``
    tracing."""
    return not (_TRACE or _is_compiling() or _is_tracing())


# --------------------------------------------------------------- availability
def kernel_built() -> bool:
    """Whether the compiled CPU kernels are usable (builds them on the first call)."""
    return extension() is not None


def paired_panels() -> bool:
    """Whether the compiled kernels have the AVX-512 paired-panel and type-by-type loops
    (float32): where many rows per type run at the GEMM rate."""
    mod = extension()
    return mod is not None and bool(getattr(mod, "paired_panels", False))


def _triton_available(device: torch.device) -> bool:
    """Triton runs on CUDA, or on the CPU under its interpreter (``TRITON_INTERPRET=1``),
    when ``structlm.ops.triton`` imports (Triton installed)."""
    if "ok" not in _TRITON_STATE:
        try:
            importlib.import_module("structlm.ops.triton")
            _TRITON_STATE["ok"] = True
        except ImportError:
            _TRITON_STATE["ok"] = False
    if not _TRITON_STATE["ok"]:
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and triton_interpret()


def resolve_backend(requested: str | Backend, device: torch.device,
                    dtype: torch.dtype | None = None) -> Backend:
    """The concrete backend for ``requested`` on ``device``: ``auto`` is the forced backend
    (:func:`force_backend`, ``STRUCTLM_BACKEND``) if any, else Triton on CUDA (not for
    float64) where it is available, else ``blocked``.

    Raises:
        RuntimeError: an explicitly requested Triton that cannot run on ``device``.
    """
    req = requested if isinstance(requested, Backend) else parse_backend(requested)
    if req is Backend.AUTO:
        if _FORCED_BACKEND:
            req = _FORCED_BACKEND[-1]
        elif backend_override():
            req = parse_backend(str(backend_override()))
    if req is Backend.AUTO:
        if device.type == "cuda" and dtype != torch.float64 and _triton_available(device):
            return Backend.TRITON
        return Backend.BLOCKED
    if req is Backend.TRITON and not _triton_available(device):
        raise RuntimeError(f"backend 'triton' is not available on device {device}: it needs "
                           "Triton and a CUDA device (or TRITON_INTERPRET=1 on the CPU)")
    return req


def _kernel_inputs_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """CPU, a kernel dtype on both, a contiguous weight, the kernel built."""
    return (x.device.type == "cpu" and x.dtype in KERNEL_DTYPES and w.dtype == x.dtype
            and w.is_contiguous() and kernel_built())


def _records(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an operation on any of ``tensors`` now."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# -------------------------------------------------------------------- calls
@dataclass(frozen=True, slots=True)
class AlgebraCall:
    """An algebra product ``x (M, K) -> (M, N)`` of a layer with ``plan``.

    ``part`` is ``None`` only when the types stay on the device (CUDA, Triton)."""

    x: torch.Tensor
    weight: torch.Tensor
    plan: BlockPlan
    part: TypePartition | None
    backend: Backend = Backend.AUTO
    bias: torch.Tensor | None = None
    kernel: bool = True
    """``False``: the best route without the compiled kernel (a backward pass)."""


@dataclass(frozen=True, slots=True)
class DenseCall:
    """A dense projection ``x (*, K) -> (*, N)`` with ``weight (N, K)``."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class FFNCall:
    """A SwiGLU FFN ``down(silu(gate(x)) * up(x))`` on ``x (*, D)``.

    ``kind`` is the FFN's structure (the model's cached check): ``"dense"`` (bias-free
    dense projections), ``"algebra"`` (bias-free algebra projections of one plan for gate
    and up) or ``None`` (anything else; ``weights`` then ``None``). ``projections`` are,
    for ``"algebra"``, each projection's ``(weight, plan, backend)``; ``part`` the rows'
    types."""

    x: torch.Tensor
    kind: str | None
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    part: TypePartition | None = None
    projections: tuple[tuple[torch.Tensor, BlockPlan, Backend], ...] = ()


@dataclass(frozen=True, slots=True)
class DecodeStepCall:
    """One step of a StructLM model's forward on embeddings ``x (B, T, D)``.

    The model supplies the facts only it knows: ``padded`` (an attention mask is
    needed), ``cache_ready`` (a filled cache of in-place layers), ``layerwise`` (types
    or scores that differ between layers), ``trained`` (a parameter autograd records),
    ``blocks_ready`` (every block is exactly what the kernel computes, and each algebra
    FFN projection would take the kernel: the model's cached plan)."""

    x: torch.Tensor
    padded: bool
    cache_ready: bool
    layerwise: bool
    trained: bool
    blocks_ready: bool


Call = AlgebraCall | DenseCall | FFNCall | DecodeStepCall


def choose(call: Call) -> Decision:
    """The route of ``call`` and why (see the module docstring)."""
    if type(call) is AlgebraCall:
        decision = _algebra(call)
    elif type(call) is DenseCall:
        decision = _dense(call)
    elif type(call) is FFNCall:
        decision = _ffn(call)
    elif type(call) is DecodeStepCall:
        decision = _decode_step(call)
    else:
        raise TypeError(f"choose() takes an AlgebraCall, DenseCall, FFNCall or "
                        f"DecodeStepCall, got {type(call).__name__}")
    if _TRACE:
        records, context = _TRACE[-1]
        records.append(TraceRecord(call, decision, None if context is None else context()))
    return decision


@dataclass(frozen=True)
class TraceRecord:
    """One decision :func:`trace` recorded, with what its ``context`` said then."""

    call: Call
    decision: Decision
    context: Any = None


@contextlib.contextmanager
def trace(context: Callable[[], Any] | None = None) -> Iterator[list[TraceRecord]]:
    """Record every decision :func:`choose` makes within the block (``context()``, if
    given, is called at each decision: e.g. the module whose forward runs). Bound decode
    calls, which cache a decision, are bypassed meanwhile (:func:`recording`), so every
    call is decided afresh."""
    records: list[TraceRecord] = []
    _TRACE.append((records, context))
    try:
        yield records
    finally:
        _TRACE.pop()


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Within the block, decisions are not recorded (a cache asking the route about a
    representative call, not a call that runs)."""
    saved = _TRACE[:]
    _TRACE.clear()
    try:
        yield
    finally:
        _TRACE[:] = saved


def recording() -> bool:
    """Whether :func:`trace` is recording now (the layers then skip their bound calls)."""
    return bool(_TRACE)


# ------------------------------------------------------------ the decisions
def _d(route: Route, reason: str) -> Decision:
    return Decision(route, reason)


_REFERENCE = _d(Route.REFERENCE, "backend reference (the oracle)")
_TRITON_DECODE = _d(Route.TRITON_DECODE,
                    f"Triton, at most triton_decode_max_rows={_TRITON_DECODE_ROWS} rows")
_TRITON_FUSED = _d(Route.TRITON_FUSED, "Triton, no measured dispatch entry for this shape")
_TRITON_MEASURED = {r: _d(r, "Triton, the measured dispatch table's choice for this shape")
                    for r in (Route.TRITON_FUSED, Route.TRITON_TWO_STAGE)}
_KERNEL = _d(Route.KERNEL, "CPU kernel: at most kernel_portable_max_rows_per_type="
             f"{_KERNEL_PORTABLE_PER_TYPE} rows per type, weight not trained")
_KERNEL_PAIRED = _d(Route.KERNEL, f"CPU kernel: float32, AVX-512 build, at most "
                    f"kernel_max_rows_per_type={_KERNEL_PER_TYPE} rows per type, weight not "
                    "trained")
_GATHERED = _d(Route.GATHERED, f"Q_q-shaped support, q >= gathered_min_q={_GATHERED_MIN_Q}, "
               f"equal rows per type <= gathered_max_rows_per_type={_GATHERED_PER_TYPE}")
_OUTPUT_MAJOR = _d(Route.OUTPUT_MAJOR, "one type, at most output_major_max_rows="
                   f"{_OUTPUT_MAJOR_ROWS} rows")
_BLOCK_MAJOR = _d(Route.BLOCK_MAJOR, "blocks shared by several present types: each read once")
_DEEP_OUTPUT_MAJOR = _d(Route.OUTPUT_MAJOR, "at least output_major_min_rows="
                        f"{_OUTPUT_MAJOR_MIN_ROWS} rows of several types, shared blocks, an "
                        "input group at most "
                        f"output_major_max_in_width={_OUTPUT_MAJOR_IN_WIDTH} wide")
_DIAG_FIRST = _d(Route.DIAG_FIRST, "the general layout")
_FORCED = {r: _d(r, "forced (force_layout)") for r in LAYOUTS}
_KERNEL_FORCED_FALLBACK = _d(Route.OUTPUT_MAJOR, "fused-rows forced but the kernel cannot "
                             "run these inputs: its PyTorch rectangles")


def _algebra(c: AlgebraCall) -> Decision:
    backend = resolve_backend(c.backend, c.x.device, c.x.dtype)
    if backend is Backend.REFERENCE:
        return _REFERENCE
    m = c.x.shape[0]
    if backend is Backend.TRITON:
        return _triton(m, c.plan.q, c.plan.in_features, c.plan.out_features)
    part = c.part
    assert part is not None, "the blocked backend needs the rows' TypePartition"
    kernel = (c.kernel and not (torch.is_grad_enabled() and c.weight.requires_grad)
              and _kernel_inputs_ok(c.x, c.weight))
    if _FORCED_LAYOUT:
        forced = _FORCED_LAYOUT[-1]
        if forced is Route.KERNEL:
            return _FORCED[forced] if kernel or not c.kernel else _KERNEL_FORCED_FALLBACK
        if forced is not Route.GATHERED or gathered_applies(c.plan, part):
            return _FORCED[forced]
    if kernel and m <= _KERNEL_PORTABLE_PER_TYPE * c.plan.q:
        return _KERNEL
    if (kernel and m <= _KERNEL_PER_TYPE * c.plan.q and c.x.dtype == torch.float32
            and paired_panels()):
        return _KERNEL_PAIRED
    if gathered_applies(c.plan, part):
        return _GATHERED
    if len(part.present) == 1 and m <= _OUTPUT_MAJOR_ROWS:
        return _OUTPUT_MAJOR
    if c.plan.has_shared_blocks and len(part.present) > 1:
        # measured on the CPU in float32 (in bf16 its per-type dW sums would round q times)
        if (m >= _OUTPUT_MAJOR_MIN_ROWS and c.x.device.type == "cpu"
                and c.x.dtype in KERNEL_DTYPES
                and c.plan.narrowest_input_group <= _OUTPUT_MAJOR_IN_WIDTH):
            return _DEEP_OUTPUT_MAJOR
        return _BLOCK_MAJOR
    return _DIAG_FIRST


def _triton(m: int, q: int, k: int, n: int) -> Decision:
    if m <= _TRITON_DECODE_ROWS:
        return _TRITON_DECODE
    mode = DISPATCH.get((q, k, n, bucket(m)))
    return _TRITON_FUSED if mode is None else _TRITON_MEASURED[Route(mode)]


def triton_route(m: int, q: int, k: int, n: int) -> Route:
    """The Triton forward mode for ``m`` rows of a ``(n, k)`` layer with ``q`` types: the
    decode kernel for a handful of rows, else the measured dispatch table's entry
    (:func:`load_dispatch`), else fused."""
    return _triton(m, q, k, n).route


def gathered_applies(plan: BlockPlan, part: TypePartition) -> bool:
    """Whether the row-first gathered layout applies to this plan and batch."""
    return (plan.diag_plus_row and plan.q >= _GATHERED_MIN_Q and part.balanced
            and part.counts[0] <= _GATHERED_PER_TYPE)


_DENSE_IN_PLACE = _d(Route.DENSE_KERNEL, "CPU kernel, at most dense_in_place_max_rows="
                     f"{DENSE_IN_PLACE_MAX_ROWS} rows: weight read in place")
_DENSE_PACKED = _d(Route.DENSE_KERNEL_PACKED, "CPU kernel, at most dense_kernel_max_rows="
                   f"{DENSE_KERNEL_MAX_ROWS} rows: panel-packed copy")
_DENSE_MANY = _d(Route.TORCH, f"more than dense_kernel_max_rows={DENSE_KERNEL_MAX_ROWS} rows")
_DENSE_NO_KERNEL = _d(Route.TORCH, "the kernel cannot run these inputs (device, dtype, "
                      "autograd, layout, or not built)")


def _dense(c: DenseCall) -> Decision:
    x, w, b = c.x, c.weight, c.bias
    k = w.shape[-1]
    if x.shape[-1] != k or x.numel() > DENSE_KERNEL_MAX_ROWS * k:
        return _DENSE_MANY if x.shape[-1] == k else _DENSE_NO_KERNEL
    if not (_kernel_inputs_ok(x, w) and not _records(x, w, b)
            and (b is None or (b.dtype == x.dtype and b.is_contiguous()
                               and b.device == x.device))):
        return _DENSE_NO_KERNEL
    return _DENSE_IN_PLACE if x.numel() <= DENSE_IN_PLACE_MAX_ROWS * k else _DENSE_PACKED


_SWIGLU = _d(Route.SWIGLU_KERNEL, f"at most decode_max_rows={DECODE_MAX_ROWS} rows, every "
             "projection on the kernel")
_FFN_ROWS = _d(Route.MODULES, f"more than decode_max_rows={DECODE_MAX_ROWS} rows")
_FFN_SHAPE = _d(Route.MODULES, "the FFN is not the bias-free SwiGLU of dense or algebra "
                "projections the kernel computes")
_FFN_NO_KERNEL = _d(Route.MODULES, "the kernel cannot run these inputs (device, dtype, "
                    "autograd, layout, or not built)")
_FFN_PROJECTION = _d(Route.MODULES, "a projection would not take the kernel (backend, "
                     "forced layout, or types)")


def _ffn(c: FFNCall) -> Decision:
    x = c.x
    d = x.shape[-1]
    if x.numel() > DECODE_MAX_ROWS * d:
        return _FFN_ROWS
    if c.kind is None or c.weights is None:
        return _FFN_SHAPE
    gate, up, down = c.weights
    if gate.shape[1] != d or (c.kind == "algebra") != (c.part is not None):
        return _FFN_SHAPE
    if not (_kernel_inputs_ok(x, gate) and up.is_contiguous() and down.is_contiguous()
            and not _records(x, gate, up, down)):
        return _FFN_NO_KERNEL
    if c.kind == "algebra":
        part = c.part
        assert part is not None
        rows = x.numel() // d
        for w, plan, backend in c.projections:
            if part.num_rows != rows or part.q != plan.q:
                return _FFN_PROJECTION
            if _algebra(AlgebraCall(x.reshape(rows, d) if w is gate or w is up else x,
                                    w, plan, part, backend)).route is not Route.KERNEL:
                return _FFN_PROJECTION
    return _SWIGLU


_STACK = _d(Route.DECODE_STACK, f"one new token per sequence, at most decode_max_rows="
            f"{DECODE_MAX_ROWS} sequences, every block on the kernel")
_STACK_SHAPE = _d(Route.MODULES, "not one new token per sequence for at most "
                  f"decode_max_rows={DECODE_MAX_ROWS} sequences")
_STACK_TRACING = _d(Route.MODULES, "torch.compile / jit tracing: the stack kernel writes "
                    "the caches in place and is not an op")
_STACK_PADDED = _d(Route.MODULES, "padded batch (attention mask)")
_STACK_CACHE = _d(Route.MODULES, "no filled cache of in-place layers")
_STACK_LAYERWISE = _d(Route.MODULES, "types or scores differ between layers")
_STACK_TRAINED = _d(Route.MODULES, "autograd records the parameters")
_STACK_INPUTS = _d(Route.MODULES, "the kernel cannot run these inputs (device, dtype, or not "
                   "built)")
_STACK_BLOCKS = _d(Route.MODULES, "a block is not exactly what the kernel computes (replaced "
                   "modules, another backend, forced layout)")


def _decode_step(c: DecodeStepCall) -> Decision:
    x = c.x
    if tracing():
        return _STACK_TRACING
    if x.dim() != 3 or x.shape[1] != 1 or x.shape[0] > DECODE_MAX_ROWS:
        return _STACK_SHAPE
    if c.padded:
        return _STACK_PADDED
    if not c.cache_ready:
        return _STACK_CACHE
    if c.layerwise:
        return _STACK_LAYERWISE
    if c.trained or _records(x):
        return _STACK_TRAINED
    if not (x.device.type == "cpu" and x.dtype in KERNEL_DTYPES and kernel_built()):
        return _STACK_INPUTS
    if not c.blocks_ready:
        return _STACK_BLOCKS
    return _STACK
