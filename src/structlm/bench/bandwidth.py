"""The memory floor of a benchmark: the machine's stream read bandwidth, measured in the
same run, and what each arm's achieved bytes/s are as a share of it.

Decode at batch 1 reads every weight it uses once per token, so its time is bounded
below by ``bytes / stream bandwidth``; a table that prints only a speed-up against a dense
arm cannot say whether that dense arm is itself near the floor. The columns here can.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

__all__ = ["gguf_bytes_per_token", "stream_read_gbps"]


def stream_read_gbps(nbytes: int = 256 << 20, trials: int = 7) -> float:
    """Median GB/s (10⁹ bytes/s) of one full read of a float32 tensor of ``nbytes`` (far
    larger than any last-level cache) with torch's current threads (``sum``: one
    vectorised pass, negligible arithmetic per byte); the first pass is a warm-up."""
    if nbytes < 1 << 20 or trials < 1:
        raise ValueError(f"stream_read_gbps needs nbytes >= 1 MiB and trials >= 1, got "
                         f"nbytes={nbytes}, trials={trials}")
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    float(x.sum())  # warm-up: pages touched, threads up
    rates = []
    for _ in range(trials):
        t0 = time.perf_counter()
        float(x.sum())
        rates.append(x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def gguf_bytes_per_token(path: Path) -> int:
    """Weight bytes one decode token reads from a GGUF model (as llama.cpp stores them:
    quantised blocks included): every tensor once, except the token embedding, of which
    one row is read — unless the model has no ``output.weight`` (a tied head reads it
    whole). The KV cache is not included."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    embed = tensors.get("token_embd.weight")
    if embed is not None and "output.weight" in tensors:  # untied: one embedding row
        rows = int(embed.shape[-1])  # GGUF shapes are (cols, rows)
        total -= int(embed.n_bytes) - int(embed.n_bytes) // rows
    return total
