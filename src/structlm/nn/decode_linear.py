"""``DecodeLinear``: ``nn.Linear`` whose few-row CPU inference runs on the compiled kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import cpu_kernels
from ..ops.blocked import FUSED_ROWS_MAX_ROWS

__all__ = ["DecodeLinear"]


class DecodeLinear(nn.Linear):
    """``nn.Linear`` (same parameters, state dict and initialisation) whose cached-decode
    calls — at most ``FUSED_ROWS_MAX_ROWS`` rows, CPU, float32/float64, no autograd —
    run on the compiled few-row kernel (:func:`~structlm.ops.cpu_kernels.dense_rows_linear`)
    instead of PyTorch's GEMV.

    This is what makes a decode-speed comparison fair: the algebra layers decode on
    that kernel, and on a 2-core machine it streams weights ~1.7x faster than MKL's
    GEMV (``benchmarks/decode_projections.py``), so the dense layers of both models
    (attention, LM head, a dense FFN) use it too. Every other call is ``F.linear``.

    Shapes: ``(*, in_features) -> (*, out_features)``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.in_features
        if (x.shape[-1] == k and x.numel() <= FUSED_ROWS_MAX_ROWS * k
                and cpu_kernels.rows_kernel_applies(x, self.weight)
                and (self.bias is None or self.bias.dtype == x.dtype)):
            y2 = cpu_kernels.dense_rows_linear(x.reshape(-1, k), self.weight,
                                               self.bias)  # (M, N)
            return y2.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)
