"""The route decision's tables: every row threshold with the measurement that set it
(:data:`THRESHOLDS`), and the Triton forward mode measured per shape on a GPU
(:data:`DISPATCH`, :func:`load_dispatch`). Only :mod:`structlm.ops.route` reads them."""

from __future__ import annotations

import json
from dataclasses import dataclass

from structlm.settings import triton_dispatch_path

__all__ = ["DISPATCH", "THRESHOLDS", "Threshold", "bucket", "load_dispatch"]


@dataclass(frozen=True)
class Threshold:
    """One row threshold of the route decision and the measurement that set it."""

    value: int
    meaning: str
    measured: str


THRESHOLDS: dict[str, Threshold] = {
    "decode_max_rows": Threshold(
        4, "most rows (sequences of one decode step) the bound per-layer decode calls, the "
        "SwiGLU kernel and the fused decode step take",
        "a decode step has one row per sequence; generate benchmarks run batches 1-4 "
        "(structlm bench generate, benchmarks/results/generate_cpu_paper110m*.md); above it "
        "the per-projection routes decide"),
    "kernel_max_rows_per_type": Threshold(
        1024, "the compiled kernel takes a float32 algebra product up to this many rows per "
        "type where the build has the AVX-512 paired-panel loops (1024 q rows in all: 2048 "
        "for Q2, 4096 for Q4 and Q2^2, 32768 for Q32); elsewhere "
        "kernel_portable_max_rows_per_type",
        "K = N = 4096, 2 threads, caches flushed, every type present, kernel vs the best "
        "PyTorch layout (python benchmarks/panel_kernel.py --threads 2 --layouts, "
        "benchmarks/results/panel_kernel/layouts_2threads_flushed_epyc.md, AMD EPYC VM): "
        "ahead at every size timed, 16 to 1024 rows per type up to 8192 rows (Q2 at 2048: "
        "232.6 vs 266.4 ms, Q4 at 4096: 267.0 vs 341.5, Q32 at 2048: 24.8 vs 39.2, Q8 at "
        "8192: 296.7 vs 387.3); its rows go in blocks of 512 (cut at type boundaries), so "
        "the accumulators and inputs stay in L2 at any M; no larger batch was timed"),
    "kernel_portable_max_rows_per_type": Threshold(
        16, "the compiled kernel's limit in float64 or without AVX-512 (its rows accumulated "
        "in memory, block by block), and the most rows per type a batch of one type reads "
        "the typed copy with (its loop streams the inputs once per output row)",
        "the earlier measurement of the block-by-block loop against the PyTorch layouts, "
        "K = N = 4096, 2 threads, flushed (benchmarks/results/panel_kernel/"
        "layouts_2threads_flushed.md): ahead at 16 q rows for every q, mostly at 32 q; no "
        "float64 or AVX2-only run since"),
    "gathered_max_rows_per_type": Threshold(
        16, "the row-first gathered layout up to this many rows per type",
        "2 CPU threads, K = N = 4096, fp32: crossover at 8-32 rows per type "
        "(benchmarks/results/layer_cpu_grid_1024x4096.md)"),
    "gathered_min_q": Threshold(
        4, "the gathered layout only from this q (it reads the diagonal blocks twice, 1/q "
        "of the weight bytes extra; below it diag-first needs at most 1 + 2q <= 7 GEMMs)",
        "same grid as gathered_max_rows_per_type"),
    "output_major_max_rows": Threshold(
        64, "the output-major layout for batches of one type up to this many rows",
        "cached decode batches on the pure-PyTorch path (the kernel unavailable), K = N = "
        "4096, 2 threads: a handful of rectangles beat diag-first's 1 + runs GEMM calls"),
    "output_major_min_rows": Threshold(
        1024, "from this many rows of several types on a support with shared blocks (CPU, "
        "float32 / float64), output-major instead of block-major when an input group is at "
        "most "
        "output_major_max_in_width wide (its rectangles merge narrow blocks into deeper "
        "GEMMs; a block read once per type costs nothing at this many rows)",
        "python benchmarks/layer_layouts.py --trials 7 (benchmarks/results/"
        "layer_layouts_epyc.md; AMD EPYC VM, 2 threads, Q2^2, every layout forced, % of "
        "the MAC ideal over F.linear): forward + backward, output-major / block-major / "
        "diag-first, study-cpu FFN 256x1024 at M = 4096 (block:32) 78 / 61 / 66%, 1024x256 "
        "67 / 60 / 62%, paper-110m 768x3072 at M = 1536 (block:192) 84 / 82 / 82% (F.linear "
        "at 86-95% of the GEMM rate measured in the run); three earlier runs the same "
        "session, output-major ahead in each (77 / 63 / 65%, 75 / 62 / 68%, 86 / 83 / 81%; "
        "81 / 70 / 69%, 74 / 63 / 65%, 82 / 79 / 77%; 69 / 51 / 62%, 66 / 53 / 60%, 85 / 73 "
        "/ 81%). Where every input group is wide (3072x768, 4096x4096) the three are within "
        "4 points and change order between runs: block-major stays"),
    "output_major_max_in_width": Threshold(
        511, "output_major_min_rows applies when the narrowest input group is at most this "
        "wide",
        "the same runs: output-major ahead at input groups of 64, 192 and 256 columns, "
        "level at 768 and 1024"),
    "dense_in_place_max_rows": Threshold(
        4, "the dense few-row kernel reads the weight in place up to this many rows; above "
        "it a panel-packed copy (+1x the weight)",
        "caches flushed, 2 threads, 4096x4096 and the SmolLM2 / paper-110m FFN shapes: the "
        "packed copy 0-17% faster at M = 8 and 8-18% at M = 32, level at M = 4, mixed at "
        "M = 1 (python benchmarks/panel_kernel.py --threads 2 --flush)"),
    "dense_kernel_max_rows": Threshold(
        32, "the dense few-row kernel up to this many rows, F.linear above",
        "against MKL, 2 threads, weights from DRAM: 1.2-3.4x faster at M = 1..16 for "
        "4096x4096, 576x1536 and 1536x576; at M = 32 2-30% faster on the paper-110m and "
        "SmolLM2 FFN shapes, 7% slower at 4096x4096 "
        "(benchmarks/results/decode_projections_cpu.md); Intel Xeon VM with the AVX-512 "
        "panel calls, weights rotated over 1 GiB: 1.08-1.28x faster at M = 32 (4096x4096, "
        "1536x576), 0.89-1.04x at M = 64 (docs/benchmarks.md, few-row panel calls)"),
    "triton_decode_max_rows": Threshold(
        4, "the Triton vector-reduction decode kernel up to this many rows",
        "not yet measured on a GPU (no GPU results are committed; benchmarks/gpu_kernels.py "
        "times the decode kernel against the tiled ones when a GPU is lent): set equal to "
        "decode_max_rows, the decode batches, where a 16-row tensor-core tile would be "
        "mostly padding"),
}
"""Every row threshold of the route decision (name -> value, meaning, measurement)."""

#: Triton forward mode per (q, K, N, power-of-two M bucket), measured on a GPU
#: (:func:`load_dispatch`): "triton-fused" or "triton-two-stage"; fused where nothing
#: was measured
DISPATCH: dict[tuple[int, int, int, int], str] = {}


def load_dispatch(path: str) -> int:
    """Load a ``dispatch.json`` written by ``benchmarks/gpu_kernels.py`` (keys
    ``"q,K,N,M"``, values ``"fused"`` / ``"two-stage"``) into the Triton mode table;
    returns the entries read."""
    with open(path) as fh:
        table = json.load(fh)
    for key, mode in table.items():
        if mode not in ("fused", "two-stage"):
            raise ValueError(f"{path}: mode {mode!r} for {key} is not 'fused' or 'two-stage'")
        q, k, n, m = (int(v) for v in key.split(","))
        DISPATCH[(q, k, n, bucket(m))] = f"triton-{mode}"
    return len(table)


def bucket(m: int) -> int:
    """The power-of-two row bucket of the dispatch table."""
    return 1 << max(0, (m - 1).bit_length())


if triton_dispatch_path():
    load_dispatch(str(triton_dispatch_path()))
