"""Small modules adapters install when a fused or gated matrix is replaced."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ConcatProjection", "GatedMLP", "linear_from", "stacked", "weight_and_bias"]


def weight_and_bias(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight (out, in), bias)`` of an ``nn.Linear``, an ``AlgebraLinear`` or a
    GPT-2 ``Conv1D`` (which stores ``(in, out)``), detached."""
    if type(module).__name__ == "Conv1D":  # transformers.pytorch_utils.Conv1D
        return module.weight.detach().t(), module.bias.detach()
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise TypeError(f"expected a linear module with a 2-D weight, got "
                        f"{type(module).__name__}")
    b = getattr(module, "bias", None)
    return w.detach(), None if b is None else b.detach()


def stacked(gate: nn.Module, up: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A gated MLP's MLP-in: ``[W_gate; W_up]`` ``(2F, d)`` and the stacked bias."""
    (wg, bg), (wu, bu) = weight_and_bias(gate), weight_and_bias(up)
    return torch.cat([wg, wu]), None if bg is None else torch.cat([bg, bu])


def linear_from(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding copies of ``weight`` ``(out, in)`` and ``bias``."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                    device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


class ConcatProjection(nn.Module):
    """A fused projection (GPT-2's ``c_attn``) as separate modules whose outputs are
    concatenated: ``[q(x), k(x), v(x)]``."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)  # (..., sum of outs)


class GatedMLP(nn.Module):
    """``down(act(g) * u)`` with ``[g, u] = proj_in(x)``: a gated MLP whose gate and up
    projections are one stacked ``(2F, d)`` matrix."""

    def __init__(self, proj_in: nn.Module, down: nn.Module, width: int,
                 act: nn.Module | None = None) -> None:
        super().__init__()
        self.proj_in, self.down, self.width = proj_in, down, width
        self.act = act if act is not None else nn.SiLU()

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        g, u = self.proj_in(x).split(self.width, dim=-1)  # (..., F) each
        return self.down(self.act(g) * u)  # (..., d)

