"""``AlgebraLinear``: a linear layer whose product rule is a fixed associative algebra."""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import torch
from torch import nn

from structlm.algebra import Algebra, AlgebraError, get_algebra, split_widths, support_of
from structlm.nn.structure import (
    EPOCH,
    StructureTracked,
    invalidate_fast_paths,
    keep_bound_call,
)
from structlm.ops import cpu_kernels
from structlm.ops.blocked import blocked_linear
from structlm.ops.partition import TypePartition, check_types
from structlm.ops.plan import make_plan
from structlm.ops.reference import effective_weight, element_mask, reference_linear
from structlm.ops.route import (
    DECODE_MAX_ROWS,
    AlgebraCall,
    Backend,
    Route,
    bound_calls_open,
    choose,
    parse_backend,
    resolve_backend,
)

__all__ = ["AlgebraLinear"]


def _check_widths(widths: Sequence[int], total: int, q: int, what: str) -> tuple[int, ...]:
    bad = [v for v in widths if isinstance(v, bool) or not isinstance(v, int | np.integer)]
    if bad:
        raise AlgebraError(f"{what} group widths {list(widths)}: {bad[0]!r} is not an integer "
                           "(a width counts features)")
    w = tuple(int(v) for v in widths)
    if len(w) != q:
        raise AlgebraError(f"{what} group widths {list(w)} have {len(w)} entries; need q={q}")
    if any(v < 1 for v in w):
        raise AlgebraError(f"{what} group widths {list(w)} must all be positive")
    if sum(w) != total:
        raise AlgebraError(f"{what} group widths {list(w)} sum to {sum(w)}, expected {total}")
    return w


class AlgebraLinear(StructureTracked, nn.Module):
    """Position-typed linear layer ``y_delta = sum_beta S[alpha,beta,delta] x_beta W_beta,delta``.

    The weight is stored exactly like ``nn.Linear`` (``weight`` of shape
    ``(out_features, in_features)``), so state dicts line up and every block stays
    learnable; a token of type ``alpha`` uses only the blocks its type allows.

    Args:
        in_features: input width ``K``.
        out_features: output width ``N``.
        algebra: catalogue name (``"Q4"``, ``"Q2^2"``, ``"graph:3:0-1,1-2"``, ...)
            or an :class:`~structlm.algebra.Algebra` with a cell layout.
        bias: add a learnable bias (dense, like ``nn.Linear``).
        group_sizes: ``(in_widths, out_widths)``, two sequences of ``q`` positive
            integers; equal widths by default.
        backend: ``"auto"`` | ``"reference"`` | ``"blocked"`` (| ``"triton"``).

    Shapes:
        ``forward(x, types)``: ``x (*, K)``, ``types (*)`` integers in ``[0, q)``
        (or a precomputed :class:`~structlm.ops.TypePartition`) -> ``(*, N)``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        algebra: str | Algebra = "Q4",
        bias: bool = False,
        group_sizes: tuple[Sequence[int], Sequence[int]] | None = None,
        backend: str | Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        alg = algebra if isinstance(algebra, Algebra) else get_algebra(algebra)
        self.algebra_name = alg.name
        self.support = support_of(alg)
        q = self.support.q
        for what, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
                raise AlgebraError(f"{what} must be a positive integer, got {v!r}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        if group_sizes is None:
            self.in_widths = split_widths(self.in_features, q, "in_features")
            self.out_widths = split_widths(self.out_features, q, "out_features")
        else:
            if len(group_sizes) != 2:
                raise AlgebraError("group_sizes must be (in_widths, out_widths)")
            self.in_widths = _check_widths(group_sizes[0], self.in_features, q, "input")
            self.out_widths = _check_widths(group_sizes[1], self.out_features, q, "output")
        if dtype is not None and not (isinstance(dtype, torch.dtype)
                                      and dtype.is_floating_point):
            raise AlgebraError(f"dtype must be a floating-point torch dtype (the weights are "
                               f"trained), got {dtype!r}")
        self.plan = make_plan(self.support, self.in_widths, self.out_widths)
        self.backend = parse_backend(backend)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, **factory))
        self.bias = nn.Parameter(torch.empty(self.out_features, **factory)) if bias else None
        self.reset_parameters()

    # ------------------------------------------------------------------ setup
    @property
    def backend(self) -> Backend:
        """The backend this layer asks for (``auto`` lets the route decide); setting it
        invalidates cached fast-path decisions."""
        return self.__dict__["_backend"]

    @backend.setter
    def backend(self, value: str | Backend) -> None:
        self.__dict__["_backend"] = parse_backend(value)
        invalidate_fast_paths(self)

    @property
    def q(self) -> int:
        """Number of position types (= feature groups)."""
        return self.support.q

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation (every block is a live parameter)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def input_fraction(self) -> torch.Tensor:
        """``(N,)`` float64: per output feature, the fraction of the ``K`` input features a
        row of its output group multiplies, averaged over the ``q`` position types (a
        uniform type mix): ``mean_alpha sum_beta mask[alpha, beta, delta] s_beta / K``.
        A dense layer is 1 everywhere; ``Q2^2``'s mean is 9/16."""
        mask = torch.from_numpy(self.support.mask.astype(np.float64))  # (q, q_in, q_out)
        s = torch.tensor(self.in_widths, dtype=torch.float64)
        per_group = (mask * s[None, :, None]).sum(1).mean(0) / self.in_features  # (q_out,)
        return per_group.repeat_interleave(torch.tensor(self.out_widths))

    @classmethod
    def from_linear(cls, linear: nn.Linear, algebra: str | Algebra = "Q4",
                    **kwargs: object) -> AlgebraLinear:
        """Convert a dense layer, keeping its weight and bias bit for bit."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, algebra,
                    bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype, **kwargs)  # type: ignore[arg-type]
        with torch.no_grad():
            layer.weight.copy_(linear.weight)
            if linear.bias is not None and layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    # ---------------------------------------------------------------- inspect
    def mac_ratio(self, types: torch.Tensor | None = None) -> Fraction:
        """Exact ``rho`` for this layer's widths (uniform type mix by default)."""
        counts = None if types is None else self._counts(types)
        return self.support.mac_ratio(self.in_widths, self.out_widths, counts)

    def macs(self, types: torch.Tensor | TypePartition) -> int:
        """Exact forward MACs for a batch with these position types."""
        return self.support.macs(self._counts(types), self.in_widths, self.out_widths)

    def _counts(self, types: torch.Tensor | TypePartition) -> list[int]:
        if isinstance(types, TypePartition):
            return types.counts
        return TypePartition(types.reshape(-1), self.q).counts

    @property
    def dead_parameters(self) -> int:
        """Weights in blocks that no type uses (only for general graphs)."""
        used = element_mask(self.support.used_blocks, list(self.in_widths), list(self.out_widths))
        return int((~used).sum())

    def to_dense(self, type_index: int) -> torch.Tensor:
        """Effective ``(out, in)`` matrix of one type (zeros outside its support)."""
        if not 0 <= type_index < self.q:
            raise ValueError(f"type {type_index} is out of range [0, {self.q})")
        return effective_weight(self.weight, self.support.mask, list(self.in_widths),
                                list(self.out_widths), type_index)

    def extra_repr(self) -> str:
        eq = len(set(self.in_widths)) == 1 and len(set(self.out_widths)) == 1
        widths = (f"widths={self.in_widths[0]}x{self.q}->{self.out_widths[0]}x{self.q}" if eq
                  else f"in_widths={list(self.in_widths)}, out_widths={list(self.out_widths)}")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"algebra={self.algebra_name}, q={self.q}, {widths}, "
                f"mac_ratio={self.mac_ratio()}, bias={self.bias is not None}, "
                f"backend={self.backend.value}")

    def compose(self, after: AlgebraLinear) -> AlgebraLinear:
        """The layer equal to ``after(self(x, t), t)`` for every type ``t``.

        By associativity ``Phi_{W2} o Phi_{W1} = Phi_{mu(W1, W2)}``: the new weight
        is the algebra product of the two weights on the block grid,
        ``W_{beta,eps} = sum_delta c[(beta,delta),(delta,eps),(beta,eps)] W1_{beta,delta}
        W2_{delta,eps}``.  Needs the same algebra with a complete cell grid, matching
        widths, and no biases.
        """
        if after.algebra_name != self.algebra_name or after.q != self.q:
            raise AlgebraError(f"cannot compose {self.algebra_name} with {after.algebra_name}")
        if not self.support.complete_grid:
            raise AlgebraError(f"{self.algebra_name} has missing cells: composition is not closed")
        if tuple(after.in_widths) != tuple(self.out_widths):
            raise AlgebraError(f"widths do not chain: {self.out_widths} vs {after.in_widths}")
        if self.bias is not None or after.bias is not None:
            raise AlgebraError("compose needs bias-free layers")
        out = AlgebraLinear(self.in_features, after.out_features, self.algebra_name,
                            group_sizes=(self.in_widths, after.out_widths), backend=self.backend,
                            device=self.weight.device, dtype=self.weight.dtype)
        io, mo, oo = self.plan.in_offsets, self.plan.out_offsets, after.plan.out_offsets
        coef = self.support.grid_coefficients
        w1, w2 = self.weight.detach(), after.weight.detach()
        new = torch.zeros_like(out.weight)
        for b in range(self.q):
            for d in range(self.q):
                for e in range(self.q):
                    c = float(coef[b, d, e])
                    if c:
                        rows, mid, cols = (slice(oo[e], oo[e + 1]), slice(mo[d], mo[d + 1]),
                                           slice(io[b], io[b + 1]))
                        new[rows, cols] += c * (w2[rows, mid] @ w1[mid, cols])
        with torch.no_grad():
            out.weight.copy_(new)
        return out

    # ---------------------------------------------------------------- forward
    def partition(self, types: torch.Tensor) -> TypePartition:
        """Row sets for ``types (*)``; build once and pass to several layers."""
        return TypePartition(types.reshape(-1), self.q)

    def forward(self, x: torch.Tensor, types: torch.Tensor | TypePartition) -> torch.Tensor:
        # the bound decode call with the parameters it was bound to, read without
        # nn.Module's attribute lookup (a decode step makes this check with cold caches,
        # where each Python frame costs microseconds)
        bound = self.__dict__.get("_bound_call")  # (binding, weight, bias, epoch) or None
        params = self._parameters  # written directly by some loaders: checked, not trusted
        if (bound is not None and type(types) is TypePartition and bound[3] == EPOCH[0]
                and params.get("weight") is bound[1] and params.get("bias") is bound[2]
                and cpu_kernels.DECODE_COPY[-1] == "typed" and bound_calls_open()):
            y = bound[0](x, types.types, bound[1], bound[2])  # (*, N), or None
            if y is not None:
                return y
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"x has last dimension {x.shape[-1]}, expected in_features={self.in_features}"
            )
        if x.dtype != self.weight.dtype:
            raise TypeError(f"x has dtype {x.dtype} but the layer's weight is {self.weight.dtype}")
        lead = x.shape[:-1]
        if x.device.type == "meta":  # shape inference (e.g. models built without memory)
            if not isinstance(types, TypePartition):
                check_types(types, self.q, lead)
            return x.new_empty(*lead, self.out_features)  # (*, N)
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        part = self._partition(types, x2, lead)  # None: the types stay on the device
        route = choose(AlgebraCall(x2, self.weight, self.plan, part, self.backend,
                                   self.bias)).route
        if route is Route.REFERENCE:
            y2 = reference_linear(x2, self.weight, part.types, self.support.mask,
                                  list(self.in_widths), list(self.out_widths))
        elif route in _TRITON_ROUTES:
            y2 = self._forward_triton(x2, types if part is None else part, lead, route)
        elif route is Route.KERNEL and not _records(x2, self.weight, self.bias):
            return self._kernel_forward(x2, part).view(*lead, self.out_features)
        else:
            y2 = blocked_linear(x2, self.weight, self.plan, part, route)  # (M, N)
        if self.bias is not None:
            y2 = y2 + self.bias
        return y2.reshape(*lead, self.out_features)

    def _partition(self, types: torch.Tensor | TypePartition, x2: torch.Tensor,
                   lead: torch.Size) -> TypePartition | None:
        """The rows' :class:`TypePartition` (checked against ``x``), or ``None`` for the
        Triton backend, which reads the types on the device (no host synchronisation)."""
        if isinstance(types, TypePartition):
            if types.num_rows != x2.shape[0] or types.q != self.q:
                raise ValueError(
                    f"partition covers {types.num_rows} rows of q={types.q}; x has "
                    f"{x2.shape[0]} rows and the layer q={self.q}"
                )
            return types
        if resolve_backend(self.backend, x2.device, x2.dtype) is Backend.TRITON:
            return None  # the kernels read the types on the device (checked there)
        return TypePartition(check_types(types, self.q, lead).to(x2.device), self.q)

    def _kernel_forward(self, x2: torch.Tensor, part: TypePartition) -> torch.Tensor:
        """``(M, K) -> (M, N)`` on the compiled CPU kernel with the bias fused; rows of one
        type also bind the layer's decode call for the next time (made on the first such
        call and remade when the weight changes: one crossing into C++ that re-checks what
        can change between calls and returns ``None`` where the route would not take it)."""
        y2 = cpu_kernels.fused_rows_linear(x2, self.weight, self.plan, part, self.bias)
        if (part.num_rows <= DECODE_MAX_ROWS and cpu_kernels.uses_typed_copy(part)
                and self._binding_usable()):
            binding = self.__dict__.get("_rows_binding")
            if binding is None or not binding.matches(self.weight):
                binding = cpu_kernels.typed_rows_binding(self.weight, self.plan,
                                                         DECODE_MAX_ROWS)
                self.__dict__["_rows_binding"] = binding
            keep_bound_call(self, binding)
        return y2

    def _binding_usable(self) -> bool:
        """Whether the bound decode call stands for the route: no override (a forced
        backend or layout, ``STRUCTLM_BACKEND``) and a backend that resolves to ``blocked``
        on the CPU without asking (auto or blocked), the typed weight copy, no tracing
        (``torch.compile`` calls the registered op) and no recording
        (:func:`~structlm.ops.route.trace` decides every call afresh)."""
        return (self.__dict__["_backend"] in _BOUND_BACKENDS and bound_calls_open()
                and cpu_kernels.decode_copy_mode() == "typed")

    def __getstate__(self) -> dict[str, object]:
        """State for pickling and ``copy.deepcopy``, without the bound decode call (a
        compiled object holding this weight; a copy binds its own on first use)."""
        state = self.__dict__.copy()
        state.pop("_rows_binding", None)
        state.pop("_bound_call", None)
        return state

    def _forward_triton(self, x2: torch.Tensor, types: torch.Tensor | TypePartition,
                        lead: torch.Size, route: Route) -> torch.Tensor:
        """``(M, K) -> (M, N)`` with the Triton kernels; no host synchronisation on CUDA."""
        from structlm.ops.triton import build_tables, register_tables, triton_linear

        if isinstance(types, TypePartition):
            flat = types.types
        else:
            flat = check_types(types, self.q, lead).to(x2.device)
            if flat.device.type == "cuda" or torch.compiler.is_compiling():
                # no host synchronisation: an out-of-range type fails asynchronously
                torch._assert_async(((flat >= 0) & (flat < self.q)).all(),
                                    f"position types must lie in [0, {self.q})")
            elif flat.numel():
                TypePartition(flat, self.q)  # eager CPU: host check with a clear message
        key = str(x2.device)
        cache = self.__dict__.setdefault("_triton_tables", {})
        if key not in cache:
            cache[key] = register_tables(build_tables(self.plan, self.support.mask, x2.device))
        return triton_linear(x2, self.weight, flat, cache[key], route)


_TRITON_ROUTES = frozenset((Route.TRITON_DECODE, Route.TRITON_FUSED, Route.TRITON_TWO_STAGE))
_BOUND_BACKENDS = frozenset((Backend.AUTO, Backend.BLOCKED))


def _records(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an operation on any of ``tensors`` now."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
