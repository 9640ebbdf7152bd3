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

__all__ = ["absolute_columns", "add_roofline_columns", "add_stream_columns", "call_bytes",
           "gemm_peak_gflops", "gguf_bytes_per_token", "roofline_seconds", "stream_read_gbps"]


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


def call_bytes(weight_elements: int, m: int, k: int, n: int, mode: str,
               element_size: int = 4) -> int:
    """Bytes one call must move at least: the weight elements it uses, the input ``(M, K)``
    and the output ``(M, N)``; a forward + backward ``fwdbwd`` three times that (the
    forward; the input gradient reads the weight and the output gradient; the weight
    gradient reads the input and the output gradient and writes the weight's shape)."""
    if mode not in ("fwd", "fwdbwd"):
        raise ValueError(f"unknown mode {mode!r}: expected 'fwd' or 'fwdbwd'")
    once = (weight_elements + m * k + m * n) * element_size
    return once if mode == "fwd" else 3 * once


def absolute_columns(dense_bytes: int, algebra_bytes: int, mac_ideal: float,
                     dense_s: float, algebra_s: float, dense_macs: int) -> dict[str, float | int]:
    """The per-row columns of the memory floor: bytes of each arm, the bytes ideal
    (dense/algebra bytes), the dense arm's multiply-adds (the algebra arm's are
    ``dense_macs / mac_ideal``; :func:`add_roofline_columns` reads both) and each arm's
    achieved GB/s."""
    return {"dense_bytes": dense_bytes, "algebra_bytes": algebra_bytes,
            "bytes_ideal": round(dense_bytes / algebra_bytes, 4), "dense_macs": dense_macs,
            "dense_gbps": round(dense_bytes / dense_s / 1e9, 6),
            "algebra_gbps": round(algebra_bytes / algebra_s / 1e9, 6)}


def roofline_seconds(nbytes: float, macs: float, stream_gbps: float,
                     peak_gflops: float) -> float:
    """The least time a call can take on this machine: the slower of reading its bytes at
    the stream bandwidth and doing its ``2 * macs`` flops at the GEMM rate."""
    return max(nbytes / (stream_gbps * 1e9), 2 * macs / (peak_gflops * 1e9))


def add_roofline_columns(rows: list[dict[str, object]], stream_gbps: float,
                         peak_gflops: float) -> None:
    """``roofline_ideal`` of each row with ``dense_bytes``: the dense arm's roofline time
    over the algebra arm's (:func:`roofline_seconds`, the algebra's multiply-adds
    ``dense_macs / ideal``), and the GEMM rate it used; in place. Where the dense call is
    bound by bytes and the algebra's by bytes too this is the bytes ideal; where the
    dense call is compute-bound (M = 32 on this machine) an algebra call that must read
    the whole weight can still gain up to the ratio of the two floors."""
    for r in rows:
        if r.get("dense_bytes", "") == "":
            continue
        dm = float(r["dense_macs"])  # type: ignore[arg-type]
        dense = roofline_seconds(float(r["dense_bytes"]), dm, stream_gbps, peak_gflops)  # type: ignore[arg-type]
        alg = roofline_seconds(float(r["algebra_bytes"]), dm / float(r["ideal"]),  # type: ignore[arg-type]
                               stream_gbps, peak_gflops)
        r["roofline_ideal"] = round(dense / alg, 4)
        r["gemm_peak_gflops"] = round(peak_gflops, 2)


_ARM_COLUMNS = (("dense_gbps", "dense_pct_of_stream"), ("algebra_gbps", "algebra_pct_of_stream"))


def add_stream_columns(rows: list[dict[str, object]], stream_gbps: list[float],
                       columns: tuple[tuple[str, str], ...] = _ARM_COLUMNS) -> None:
    """Add the stream read bandwidth measured in the run (mean of ``stream_gbps``, e.g.
    before and after, both kept) and, for each ``(gbps column, % column)`` of ``columns``,
    that GB/s as a share of it (``""`` where the GB/s is blank: a row with no memory floor,
    e.g. a compute-bound prefill), in place."""
    floor = round(statistics.mean(stream_gbps), 2)
    for r in rows:
        r["stream_read_gbps"] = floor
        r["stream_read_gbps_before_after"] = ";".join(f"{g:.2f}" for g in stream_gbps)
        for gbps_key, pct_key in columns:
            gbps = r.get(gbps_key, "")
            r[pct_key] = "" if gbps == "" else round(100 * float(gbps) / floor, 1)  # type: ignore[arg-type]


def gemm_peak_gflops(n: int = 1024, trials: int = 5) -> float:
    """Median GFLOP/s (``2 n³`` per call) of a float32 ``n × n`` matrix product with torch's
    current threads: the compute ceiling a compute-bound step is judged against."""
    if n < 64 or trials < 1:
        raise ValueError(f"gemm_peak_gflops needs n >= 64 and trials >= 1, got n={n}, "
                         f"trials={trials}")
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    torch.mm(a, b)  # warm-up
    rates = []
    for _ in range(trials):
        t0 = time.perf_counter()
        torch.mm(a, b)
        rates.append(2 * n**3 / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)
