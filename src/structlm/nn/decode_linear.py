"""``DecodeLinear``: ``nn.Linear`` whose few-row CPU inference runs on the compiled kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from structlm.nn.structure import EPOCH, StructureTracked, keep_bound_call
from structlm.ops import cpu_kernels
from structlm.ops.route import (
    DENSE_IN_PLACE_MAX_ROWS,
    DenseCall,
    Route,
    choose,
    dense_bound_calls_open,
)

__all__ = ["DecodeLinear", "fast_linear"]


def fast_linear(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on the project's fastest dense path for the call, as the route decides
    (:class:`~structlm.ops.route.DenseCall`): the compiled few-row kernel for a few rows
    on the CPU, else ``F.linear`` (MKL).

    Shapes: ``(*, in) -> (*, out)``."""
    route = choose(DenseCall(x, weight, bias)).route
    if route is Route.TORCH:
        return F.linear(x, weight, bias)
    y2 = cpu_kernels.dense_rows_linear(x.reshape(-1, weight.shape[-1]), weight, bias,
                                       packed=route is Route.DENSE_KERNEL_PACKED)  # (M, N)
    return y2.view(*x.shape[:-1], weight.shape[0])


class DecodeLinear(StructureTracked, nn.Linear):
    """``nn.Linear`` (same parameters, state dict and initialisation) whose cached-decode
    calls — a few rows (``dense_kernel_max_rows``), CPU, float32/float64, no autograd, as
    the route decides — run on the compiled few-row kernel
    (:func:`~structlm.ops.cpu_kernels.dense_rows_linear`) instead of PyTorch's GEMV; after
    the first such call through a bound compiled call
    (:func:`~structlm.ops.cpu_kernels.dense_rows_binding`, the same crossing the algebra
    layers' decode calls make, remade when the weight changes).

    This is what makes a decode-speed comparison fair: the algebra layers decode on
    that kernel, and on a 2-core machine it streams weights ~1.7x faster than MKL's
    GEMV (``benchmarks/decode_projections.py``), so the dense layers of both models
    (attention, LM head, a dense FFN) use it too. Every other call is ``F.linear``.

    Shapes: ``(*, in_features) -> (*, out_features)``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the bound call with the parameters it was bound to (see AlgebraLinear.forward)
        bound = self.__dict__.get("_bound_call")  # (binding, weight, bias, epoch) or None
        params = self._parameters  # written directly by some loaders: checked, not trusted
        if (bound is not None and bound[3] == EPOCH[0] and params.get("weight") is bound[1]
                and params.get("bias") is bound[2] and dense_bound_calls_open()):
            y = bound[0](x, _NO_TYPES, bound[1], bound[2])  # (*, out), or None: route refuses
            if y is not None:
                return y
        binding = self.__dict__.get("_rows_binding")
        route = choose(DenseCall(x, self.weight, self.bias)).route
        if route is Route.TORCH:
            return F.linear(x, self.weight, self.bias)  # (*, in) -> (*, out)
        y2 = cpu_kernels.dense_rows_linear(x.reshape(-1, self.in_features), self.weight,
                                           self.bias, packed=route is Route.DENSE_KERNEL_PACKED)
        if route is Route.DENSE_KERNEL:
            if binding is None or not binding.matches(self.weight):
                binding = cpu_kernels.dense_rows_binding(
                    self.weight, DENSE_IN_PLACE_MAX_ROWS)  # more rows: the packed copy
                self.__dict__["_rows_binding"] = binding
            keep_bound_call(self, binding)
        return y2.view(*x.shape[:-1], self.out_features)  # (M, out) -> (*, out)

    def __getstate__(self) -> dict[str, object]:
        """State for pickling and ``copy.deepcopy``, without the bound decode call."""
        state = self.__dict__.copy()
        state.pop("_rows_binding", None)
        state.pop("_bound_call", None)
        return state


#: the bound dense call reads no types
_NO_TYPES = torch.empty(0, dtype=torch.int64)
