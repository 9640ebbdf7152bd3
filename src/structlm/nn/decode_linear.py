"""``DecodeLinear``: ``nn.Linear`` whose few-row CPU inference runs on the compiled kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from structlm.ops import cpu_kernels, cpu_ops

__all__ = ["DENSE_ROWS_MAX_ROWS", "DecodeLinear", "dense_rows_applies", "fast_linear"]


#: Largest batch the dense few-row kernel takes in :func:`fast_linear`, the same as the
#: algebra layers' kernel limit from q = 4 (measured against MKL, 2 threads, weights from
#: DRAM: 1.2-3.4x faster at M = 1..16 for 4096x4096, 576x1536 and 1536x576; at M = 32
#: 2-30% faster on the paper-110m and SmolLM2 FFN shapes, 7% slower at 4096x4096).
DENSE_ROWS_MAX_ROWS = 32


def dense_rows_applies(x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None) -> bool:
    """The one gate of the dense few-row CPU kernel: ``x`` ``(*, in)`` with at most
    ``DENSE_ROWS_MAX_ROWS`` rows and :func:`~structlm.ops.cpu_kernels.rows_kernel_applies`
    (CPU, float32/float64, nothing for autograd to record, the kernel built), and a bias,
    if any, contiguous, of ``x``'s dtype and device and not being trained."""
    k = weight.shape[-1]
    return (x.shape[-1] == k and x.numel() <= DENSE_ROWS_MAX_ROWS * k
            and cpu_kernels.rows_kernel_applies(x, weight)
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()
                                  and bias.device == x.device
                                  and not (torch.is_grad_enabled() and bias.requires_grad))))


def fast_linear(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on the project's fastest dense path for the call: the compiled
    few-row kernel where :func:`dense_rows_applies`, else ``F.linear`` (MKL).

    Shapes: ``(*, in) -> (*, out)``."""
    if dense_rows_applies(x, weight, bias):
        y2 = cpu_kernels.dense_rows_linear(x.reshape(-1, weight.shape[-1]), weight,
                                           bias)  # (M, N)
        return y2.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class DecodeLinear(nn.Linear):
    """``nn.Linear`` (same parameters, state dict and initialisation) whose cached-decode
    calls — at most ``DENSE_ROWS_MAX_ROWS`` rows, CPU, float32/float64, no autograd —
    run on the compiled few-row kernel (:func:`~structlm.ops.cpu_kernels.dense_rows_linear`)
    instead of PyTorch's GEMV; after the first such call through a bound compiled call
    (:func:`~structlm.ops.cpu_kernels.dense_rows_binding`, the same crossing the algebra
    layers' decode calls make, remade when the weight changes).

    This is what makes a decode-speed comparison fair: the algebra layers decode on
    that kernel, and on a 2-core machine it streams weights ~1.7x faster than MKL's
    GEMV (``benchmarks/decode_projections.py``), so the dense layers of both models
    (attention, LM head, a dense FFN) use it too. Every other call is ``F.linear``.

    Shapes: ``(*, in_features) -> (*, out_features)``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        binding = self.__dict__.get("_rows_binding")
        if binding is not None and not cpu_ops.tracing():  # None where the gate refuses
            y = binding(x, _NO_TYPES, self.weight, self.bias)  # (*, out), or None
            if y is not None:
                return y
        if dense_rows_applies(x, self.weight, self.bias):
            y2 = cpu_kernels.dense_rows_linear(x.reshape(-1, self.in_features), self.weight,
                                               self.bias)  # (M, out)
            if binding is None or not binding.matches(self.weight):
                self.__dict__["_rows_binding"] = cpu_kernels.dense_rows_binding(
                    self.weight, cpu_kernels.DENSE_IN_PLACE_MAX_ROWS)  # more: packed copy
            return y2.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)  # (*, in) -> (*, out)

    def __getstate__(self) -> dict[str, object]:
        """State for pickling and ``copy.deepcopy``, without the bound decode call."""
        state = self.__dict__.copy()
        state.pop("_rows_binding", None)
        return state


#: the bound dense call reads no types
_NO_TYPES = torch.empty(0, dtype=torch.int64)
