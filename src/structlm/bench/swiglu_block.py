"""The layer benchmark's SwiGLU rows: the whole FFN block ``down(silu(gate x) * up x)``,
dense vs algebra, the same activation on both sides.

The algebra arm is the model's own FFN module (:class:`~structlm.models.StructLMMLP`
with ``AlgebraLinear`` projections: its one-call compiled kernel at a few rows without a
graph, the blocked backend otherwise). The dense arm is the fastest of the dense paths
the project has for the call, timed in the same interleaved trials and named in the
row: three ``F.linear`` s, ``gate`` and ``up`` fused into one ``F.linear`` of ``2F``
outputs, and (up to ``DENSE_ARM_KERNEL_MAX_ROWS`` rows, forward) the compiled SwiGLU
kernel on the dense weights and three calls of the dense few-row kernel.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from structlm.bench.bandwidth import absolute_columns, call_bytes
from structlm.bench.timing import DENSE_ARM_KERNEL_MAX_ROWS, CacheFlusher, interleaved_medians
from structlm.models import config_from_preset
from structlm.models.modeling_structlm import StructLMMLP
from structlm.nn import get_schedule
from structlm.ops import cpu_kernels
from structlm.ops.route import AlgebraCall, DenseCall, FFNCall, Route, choose, trace

__all__ = ["time_swiglu_block"]


def _dense_paths(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor,
                 mode: str, gen: torch.Generator) -> dict[str, Callable[[], object]]:
    """The dense candidates for ``x`` ``(M, D)``, weights ``(F, D)``, ``(F, D)``,
    ``(D, F)``."""
    f = wg.shape[0]
    wgu = torch.cat([wg, wu]).contiguous()  # (2F, D): gate and up in one GEMM

    def three(xx: torch.Tensor, g: torch.Tensor, u: torch.Tensor, d: torch.Tensor
              ) -> torch.Tensor:
        return F.linear(F.silu(F.linear(xx, g)) * F.linear(xx, u), d)  # (M, D)

    def fused(xx: torch.Tensor, gu: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        h = F.linear(xx, gu)  # (M, 2F)
        return F.linear(F.silu(h[:, :f]) * h[:, f:], d)  # (M, D)

    if mode == "fwd":
        paths: dict[str, Callable[[], object]] = {
            "F.linear x3": lambda: three(x, wg, wu, wd),
            "F.linear gate+up fused": lambda: fused(x, wgu, wd)}
        if (x.shape[0] <= DENSE_ARM_KERNEL_MAX_ROWS
                and choose(DenseCall(x[:1], wg)).route is not Route.TORCH):
            paths["swiglu kernel"] = lambda: cpu_kernels.swiglu_rows(x, wg, wu, wd)
            paths["dense-rows kernel x3"] = lambda: cpu_kernels.dense_rows_linear(
                F.silu(cpu_kernels.dense_rows_linear(x, wg))
                * cpu_kernels.dense_rows_linear(x, wu), wd)
        return paths
    xg = x.clone().requires_grad_(True)
    g_out = torch.randn(x.shape[0], wd.shape[0], generator=gen)
    leaves3 = [t.clone().requires_grad_(True) for t in (wg, wu, wd)]
    leaves2 = [wgu.clone().requires_grad_(True), wd.clone().requires_grad_(True)]
    return {
        "F.linear x3": lambda: torch.autograd.grad(three(xg, *leaves3), [xg, *leaves3], g_out),
        "F.linear gate+up fused": lambda: torch.autograd.grad(fused(xg, *leaves2),
                                                              [xg, *leaves2], g_out)}


def time_swiglu_block(m: int, d: int, f: int, algebra: str, schedule: str, mode: str,
                      trials: int, seed: int, flusher: CacheFlusher | None,
                      flush_max_m: int) -> dict[str, Any]:
    """One SwiGLU row of the layer benchmark (``K = D``, ``N = F``)."""
    gen = torch.Generator().manual_seed(seed)
    mlp = StructLMMLP(config_from_preset("tiny", algebra, hidden_size=d, intermediate_size=f))
    with torch.no_grad():
        for lin, fan_in in ((mlp.gate, d), (mlp.up, d), (mlp.down, f)):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / fan_in**0.5)
    q = mlp.gate.q
    types = get_schedule(schedule, q)(torch.arange(m))
    start = time.perf_counter()
    part = mlp.gate.partition(types)
    partition_us = (time.perf_counter() - start) * 1e6
    x = torch.randn(m, d, generator=gen)
    weights = [lin.weight.detach() for lin in (mlp.gate, mlp.up, mlp.down)]
    paths = _dense_paths(x, *weights, mode, gen)
    if mode == "fwd":
        def algebra_fn() -> object:
            with torch.no_grad():
                return mlp(x.unsqueeze(0), part)  # (1, M, D)
    else:
        xg = x.clone().requires_grad_(True)
        g_out = torch.randn(1, m, d, generator=gen)
        params = [mlp.gate.weight, mlp.up.weight, mlp.down.weight]

        def algebra_fn() -> object:
            return torch.autograd.grad(mlp(xg.unsqueeze(0), part), [xg, *params], g_out)
    flushed = flusher is not None and m <= flush_max_m
    fns = {**paths, "algebra": algebra_fn}
    with torch.no_grad() if mode == "fwd" else torch.enable_grad():
        medians = interleaved_medians(list(fns.values()), trials,
                                      before_each=flusher if flushed else None)
    times = dict(zip(fns, medians, strict=True))
    t_alg = times.pop("algebra")
    dense_path = min(times, key=times.__getitem__)
    t_dense = times[dense_path]
    rho_in, rho_out = mlp.gate.mac_ratio(types), mlp.down.mac_ratio(types)
    rho = (2 * rho_in + rho_out) / 3  # gate, up: (F, D); down: (D, F) — equal MACs each
    speedup = t_dense / t_alg
    with torch.no_grad() if mode == "fwd" else torch.enable_grad(), trace() as records:
        algebra_fn()
    ffn = [r.decision.route for r in records if type(r.call) is FFNCall]
    if ffn and ffn[0] is Route.SWIGLU_KERNEL:
        layout = "swiglu kernel"
    else:  # the projections' routes (a trained weight never takes the kernel)
        layout = "/".join(sorted({r.decision.route.value for r in records
                                  if type(r.call) is AlgebraCall}))
    used = sum(lin.support.weight_elements(part.present, lin.in_widths, lin.out_widths)
               for lin in (mlp.gate, mlp.up, mlp.down))
    # weights, the input and the output (the (M, F) intermediates are left out)
    passes = 1 if mode == "fwd" else 3
    floor = absolute_columns(call_bytes(3 * d * f, m, d, d, mode),
                             call_bytes(used, m, d, d, mode), 1 / float(rho), t_dense, t_alg,
                             passes * 3 * m * d * f)
    return {
        "kind": "swiglu", "algebra": algebra, "q": q, "schedule": schedule, "mode": mode,
        "M": m, "K": d, "N": f, "dtype": "float32", "dense_path": dense_path,
        "dense_flinear_ms": round(times["F.linear x3"] * 1e3, 4),
        "dense_ms": round(t_dense * 1e3, 4), "algebra_ms": round(t_alg * 1e3, 4),
        "speedup": round(speedup, 4), "ideal": round(1 / float(rho), 4),
        "frac_of_ideal": round(speedup * float(rho), 4), "rho": str(rho),
        "types_present": len(part.present), "flushed": flushed, "layout": layout,
        "partition_us": round(partition_us, 1), "trials": trials, **floor,
    }
