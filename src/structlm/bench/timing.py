"""Timing helpers: environment capture, interleaved trials, cache flushing."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from structlm.cpu_malloc import malloc_setting
from structlm.settings import omp_wait_policy

__all__ = ["CacheFlusher", "environment", "interleaved_medians", "warn_if_passive_wait",
           "write_csv_and_markdown", "write_csv_atomic"]


#: Up to this many rows (forward) the benchmarks time the project's dense few-row kernels
#: beside ``F.linear`` in their dense arm: they beat MKL up to M = 16-32 on this machine.
DENSE_ARM_KERNEL_MAX_ROWS = 32


def warn_if_passive_wait() -> str | None:
    """A warning (printed to stderr, and returned) when ``OMP_WAIT_POLICY`` is
    ``PASSIVE``: the threads then sleep between parallel regions and every region pays a
    wake-up: on a 2-core AMD EPYC VM a tiny 2-thread kernel call took 48 us with it against
    4 us without (back to back), and a SmolLM2 decode step has a few hundred regions (its
    decode ran 1.8x slower in a run minutes apart, llama.cpp's OpenMP build too), so
    timings taken under it describe the wake-ups. Recorded in every run's environment
    (``omp_wait_policy``)."""
    if omp_wait_policy().strip().upper() != "PASSIVE":
        return None
    msg = ("warning: OMP_WAIT_POLICY=PASSIVE: every parallel region wakes sleeping threads, "
           "which slows short calls and decode steps (a 2-thread region 48 us instead of 4 us "
           "on a 2-core VM); unset it for timings that describe the kernels")
    print(msg, file=sys.stderr, flush=True)
    return msg


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict[str, str]:
    """Where the numbers come from: device, library versions, threads, allocator, the
    OpenMP wait policy (see :func:`warn_if_passive_wait`), date."""
    try:
        import triton  # type: ignore[import-not-found]

        triton_version = triton.__version__
    except Exception:
        triton_version = "n/a"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpu": _cpu_model(),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "threads": str(torch.get_num_threads()),
        "malloc": malloc_setting(),
        "omp_wait_policy": omp_wait_policy(),
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


class CacheFlusher:
    """Evicts caches by *reading* a buffer much larger than the last-level cache.

    Reading (not writing) leaves the cache full of clean lines, so the timed call
    that follows pays for its own reads only, not for write-backs of the flush.
    """

    def __init__(self, mib: int = 512) -> None:
        self.buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)

    def __call__(self) -> None:
        self.buf.sum()


def interleaved_medians(
    fns: Sequence[Callable[[], object]],
    trials: int,
    warmup: int = 1,
    before_each: Callable[[], None] | None = None,
) -> list[float]:
    """Median seconds of each function over ``trials`` interleaved rounds.

    Round ``i`` runs the functions in forward order for even ``i`` and reversed for
    odd ``i`` so that neither side always runs first (warm-up rounds are untimed).
    ``before_each`` (e.g. a cache flush) runs outside the timed region.
    """
    times: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + trials):
        order = list(range(len(fns))) if i % 2 == 0 else list(range(len(fns)))[::-1]
        for j in order:
            if before_each is not None:
                before_each()
            t0 = time.perf_counter()
            fns[j]()
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[j].append(dt)
    return [statistics.median(t) for t in times]


def write_csv_atomic(path: str, rows: list[dict[str, object]]) -> None:
    """Write rows (dicts with the same keys) to ``path`` atomically."""
    import csv

    if not rows:
        raise ValueError("no rows to write")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def read_csv_rows(path: str) -> list[dict[str, str]]:
    """The rows of a benchmark CSV."""
    import csv

    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def environment_line(rows: list[dict[str, str]]) -> str:
    """``Environment: k=v, ...`` from the ``env_*`` columns of a benchmark CSV's rows."""
    env = {k[4:]: v for k, v in rows[0].items() if k.startswith("env_")}
    return "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items())


def write_csv_and_markdown(out_prefix: str, rows: list[dict[str, object]],
                           markdown: Callable[[list[dict[str, str]]], str]) -> None:
    """``<out_prefix>.csv`` from ``rows`` (with the ``env_*`` columns of
    :func:`environment` added), then ``<out_prefix>.md`` drawn from that CSV by
    ``markdown(rows read back)``, both written atomically; prints where."""
    from pathlib import Path

    from structlm.atomic import atomic_write_text

    out = Path(out_prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {f"env_{k}": v for k, v in environment().items()}
    csv_path, md_path = out.with_name(out.name + ".csv"), out.with_name(out.name + ".md")
    write_csv_atomic(str(csv_path), [{**r, **env} for r in rows])
    atomic_write_text(md_path, markdown(read_csv_rows(str(csv_path))))
    print(f"wrote {csv_path} and {md_path}")
