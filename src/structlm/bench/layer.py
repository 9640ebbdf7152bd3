"""Layer benchmark: the fastest dense path vs ``AlgebraLinear`` in the same run.

The dense arm is ``F.linear`` (MKL) and, where the project has one for the shape (a
forward of at most ``DENSE_ARM_KERNEL_MAX_ROWS`` rows on the CPU), its dense few-row kernel,
called as a function and as the ``DecodeLinear`` module (whose calls cross into C++ bound,
like the algebra layer's); a forward of more rows adds the panel kernel the algebra layer
runs (on the dense weight's panel-packed copy, one group: on the AMD EPYC VM it keeps up
with MKL or beats it by up to 10%); all are timed in the same interleaved trials and the fastest
is the reference (named in the table), so a ratio above the ideal means something to
explain, not an unfair baseline. Interleaved trials (order alternates), medians, ratio
dense/algebra next to the ideal ``1/rho`` of the batch; CSV with the environment, a
Markdown table and a plot, both drawn from the CSV. Small batches (``M <= 32``) read
weights that are not in cache, as a decode step of a model larger than the last-level
cache does. Forward rows by default *rotate* (``cold="rotate"``): the layer is
replicated until the weights alone hold 1 GiB (twice this machine's 480 MiB last-level
cache), and each call of an arm runs on its next copy, the arms staggered so that no arm
reads a copy another has just read, so its weights (and the algebra arm's decode copies)
come from memory while the code stays warm, as between the layers of a decode step.
``cold="flush"`` (and every SwiGLU and forward + backward row) reads a 512 MiB buffer
before each call instead: the code, Python objects and page tables are cold too, which
costs ~40-100 us a call on this machine (``x.add(1)`` on 64 floats: 4 us warm, 97 us
after the flush) and dominates the M = 1 calls of small weights.
"""

from __future__ import annotations

import csv
import itertools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Annotated

import torch
import torch.nn.functional as F
from tqdm import tqdm

from structlm.bench.bandwidth import (
    absolute_columns,
    add_roofline_columns,
    add_stream_columns,
    call_bytes,
    gemm_peak_gflops,
    stream_read_gbps,
)
from structlm.bench.swiglu_block import time_swiglu_block
from structlm.bench.timing import (
    DENSE_ARM_KERNEL_MAX_ROWS,
    CacheFlusher,
    environment,
    environment_line,
    interleaved_medians,
    write_csv_atomic,
)
from structlm.config import ConfigError, Distinct, NonEmpty, OneOf, Range, validated
from structlm.nn import AlgebraLinear, DecodeLinear, get_schedule
from structlm.ops import cpu_kernels
from structlm.ops.route import AlgebraCall, DenseCall, Route, choose, trace

__all__ = ["PRESETS", "LayerBenchConfig", "markdown_from_csv", "plot_from_csv", "run_layer_bench"]


_SIZE = Annotated[int, Range(ge=1)]


@dataclass(frozen=True)
@validated
class LayerBenchConfig:
    """What to time. ``shapes`` are ``(K, N)``; ``modes`` are ``fwd`` / ``fwdbwd``."""

    ms: Annotated[tuple[_SIZE, ...], NonEmpty(), Distinct()] = (1, 32, 512, 2048)
    """Batch sizes M (rows) timed."""
    shapes: Annotated[tuple[tuple[_SIZE, _SIZE], ...], Distinct()] = (
        (1024, 4096), (2048, 8192), (4096, 4096))
    """Weight shapes KxN (in x out), e.g. 1024x4096,4096x4096."""
    blocks: Annotated[tuple[tuple[_SIZE, _SIZE], ...], Distinct()] = ()
    """Whole SwiGLU FFN blocks DxF (gate, up: D -> F; down: F -> D) timed as one row each."""
    algebras: Annotated[tuple[str, ...], NonEmpty(), Distinct()] = (
        "Q2", "Q4", "Q8", "Q16", "Q32", "Q2^2")
    """Algebras timed against the dense layer."""
    schedules: Annotated[tuple[str, ...], NonEmpty(), Distinct()] = ("cyclic", "block")
    """Type schedules of the rows: cyclic (p mod q) and/or block."""
    modes: Annotated[tuple[Annotated[str, OneOf("fwd", "fwdbwd")], ...], NonEmpty(),
                     Distinct()] = ("fwd", "fwdbwd")
    """fwd (forward) and/or fwdbwd (forward + backward)."""
    trials: Annotated[int, Range(ge=1)] = 7
    """Interleaved trials per configuration (medians reported)."""
    threads: Annotated[int, Range(ge=1)] = 2
    """Torch threads."""
    flush_max_m: Annotated[int, Range(ge=0, note="0: never cold")] = 32
    """Up to this M, every timed call reads weights not in cache (see ``cold``)."""
    cold: Annotated[str, OneOf("rotate", "flush")] = "rotate"
    """How a linear row's weights are kept out of cache: ``rotate`` (the layer replicated
    until the weights hold >= ``rotate_mib``, each call of an arm on its next copy, the arms
    staggered: cold weights, warm code, as in a decode step) or ``flush`` (a 512 MiB read
    before each call: code, Python objects and page tables cold too, ~40-100 us more per
    call here). SwiGLU rows and forward + backward rows always flush."""
    rotate_mib: Annotated[int, Range(ge=1)] = 1024
    """With ``cold: rotate``: the least memory the copies of a layer hold."""
    seed: Annotated[int, Range(ge=0)] = 0
    """Seed of inputs and weights."""
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Cross-field checks (each field's own range is checked by ``@validated``)."""
        from structlm.algebra import num_types

        for what, dims in (("shapes", self.shapes), ("blocks", self.blocks)):
            odd = [d for d in dims if len(d) != 2]
            if odd:
                raise ConfigError(f"{what}: {odd} are not KxN pairs")
        if not self.shapes and not self.blocks:
            raise ConfigError("shapes and blocks are both empty: give at least one")
        for a in self.algebras:
            q = num_types(a)  # raises naming an unknown algebra
            for what, dims in (("shapes", self.shapes), ("blocks", self.blocks)):
                bad = [f"{k}x{n}" for k, n in dims if k % q or n % q]
                if bad:
                    raise ValueError(f"{what} {bad}: both sides must be divisible by q={q} of "
                                     f"{a} (equal group widths)")
            for s in self.schedules:
                try:
                    get_schedule(s, q)
                except ValueError as e:
                    raise ConfigError(f"schedules: {e}") from None


PRESETS: dict[str, LayerBenchConfig] = {
    # the full grid (hours on 2 cores)
    "full": LayerBenchConfig(),
    # the headline point of the targets
    "target": LayerBenchConfig(ms=(2048,), shapes=((4096, 4096),),
                               algebras=("Q4", "Q2^2", "Q8", "Q16", "Q32"),
                               schedules=("cyclic",), trials=5),
    # small batches: M = 32 with every type present, M = 1 decode
    "small": LayerBenchConfig(ms=(1, 32), shapes=((4096, 4096),),
                              algebras=("Q2", "Q4", "Q8", "Q16", "Q32", "Q2^2"),
                              schedules=("cyclic",), trials=9),
    # the FFN shapes users run: paper-110m (D 768, F 1536) and SmolLM2-135M (576, 1536),
    # each projection and the whole SwiGLU block
    "shapes": LayerBenchConfig(ms=(1, 32, 512, 2048),
                               shapes=((768, 1536), (1536, 768), (576, 1536), (1536, 576)),
                               blocks=((768, 1536), (576, 1536)), algebras=("Q2^2", "Q4"),
                               schedules=("cyclic",), trials=7),
    # a one-minute look for the demo
    "quick": LayerBenchConfig(ms=(1, 32, 512), shapes=((2048, 4096),),
                              algebras=("Q2", "Q4", "Q2^2", "Q8", "Q16"),
                              schedules=("cyclic",), trials=5),
}


def _time_one(cfg: LayerBenchConfig, m: int, k: int, n: int, algebra: str, schedule: str,
              mode: str, flusher: CacheFlusher | None) -> dict[str, object]:
    gen = torch.Generator().manual_seed(cfg.seed)
    layer = _random_layer(k, n, algebra, gen)
    w = layer.weight
    types = get_schedule(schedule, layer.q)(torch.arange(m))
    start = time.perf_counter()
    part = layer.partition(types)
    partition_us = (time.perf_counter() - start) * 1e6
    x = torch.randn(m, k, generator=gen)
    rotating = (mode == "fwd" and cfg.cold == "rotate" and flusher is not None
                and m <= cfg.flush_max_m)
    layers = [layer]
    if rotating:  # copies until they hold rotate_mib: each call reads a cold copy
        layers += [_random_layer(k, n, algebra, gen)
                   for _ in range(_copies(layer, cfg.rotate_mib) - 1)]
    # each arm starts at its own copy: no arm reads a copy another arm has just read
    arms = ("dense", "rows", "module", "algebra", "bare dense", "bare algebra")
    at = {arm: _cycle(len(layers), i * len(layers) // len(arms)) for i, arm in enumerate(arms)}
    if mode == "fwd":
        def dense() -> object:
            with torch.no_grad():
                return F.linear(x, layers[next(at["dense"])].weight)

        def algebra_fn() -> object:
            with torch.no_grad():
                return layers[next(at["algebra"])](x, part)
    elif mode == "fwdbwd":
        xg = x.clone().requires_grad_(True)
        g = torch.randn(m, n, generator=gen)

        def dense() -> object:
            return torch.autograd.grad(F.linear(xg, w), [xg, w], g)

        def algebra_fn() -> object:
            return torch.autograd.grad(layer(xg, part), [xg, w], g)
    else:
        raise ValueError(f"unknown mode {mode!r}: expected 'fwd' or 'fwdbwd'")
    flushed = flusher is not None and m <= cfg.flush_max_m
    fns = {"F.linear": dense, "algebra": algebra_fn}
    wd = w.detach()
    # one detached view per copy, made once: the kernels' packed copies are cached per
    # tensor object, and a fresh `.detach()` per call would re-pack the weight every call
    # (at M = 2048, 4096^2 the dense arm took 334-339 ms so, the packed call alone 303)
    detached = [lay.weight.detach() for lay in layers]
    if (mode == "fwd" and m <= DENSE_ARM_KERNEL_MAX_ROWS
            and choose(DenseCall(x[:1], wd)).route is not Route.TORCH):
        def dense_rows() -> object:  # the project's dense few-row kernel (decode's GEMV)
            return cpu_kernels.dense_rows_linear(x, detached[next(at["rows"])])

        dense_layers = []
        for lay in layers:
            dense_layer = DecodeLinear(k, n, bias=False)
            dense_layer.weight = lay.weight  # the same weight; its calls cross into C++
            dense_layers.append(dense_layer)  # bound, as the algebra layer's do

        def dense_module() -> object:
            with torch.no_grad():
                return dense_layers[next(at["module"])](x)

        fns = {"F.linear": dense, "dense-rows kernel": dense_rows,
               "DecodeLinear": dense_module, "algebra": algebra_fn}
        # the bare arms call the in-place kernels: only where the modules take them too
        # (a few more rows run the dense packed layout, and the difference would be a
        # layout's, not a call's cost)
        if (len(part.present) == 1 and cpu_kernels.fused_rows_available()
                and choose(DenseCall(x, wd)).route is Route.DENSE_KERNEL):
            fns.update(_bare_kernels(x, layers, part, at))
    elif mode == "fwd" and cpu_kernels.fused_rows_available():
        def dense_packed() -> object:  # the algebra kernel's loop on a dense weight
            return cpu_kernels.dense_rows_linear(x, detached[next(at["rows"])], packed=True)

        fns["dense packed kernel"] = dense_packed
    # every copy once untimed (bindings and copies made), then the trials
    times = dict(zip(fns, interleaved_medians(
        list(fns.values()), cfg.trials, warmup=len(layers),
        before_each=flusher if flushed and not rotating else None), strict=True))
    bare = {arm: times.pop(arm) for arm in ("bare dense", "bare algebra") if arm in times}
    t_alg = times.pop("algebra")
    dense_path = min(times, key=times.__getitem__)  # the fastest dense path, this run
    t_dense = times[dense_path]
    rho = layer.mac_ratio(types)
    speedup = t_dense / t_alg
    used = layer.support.weight_elements(part.present, layer.in_widths, layer.out_widths)
    passes = 1 if mode == "fwd" else 3  # fwd+bwd: the forward and the two gradients
    floor = absolute_columns(call_bytes(k * n, m, k, n, mode), call_bytes(used, m, k, n, mode),
                             1 / float(rho), t_dense, t_alg, passes * m * k * n)
    return {
        "kind": "linear", "algebra": algebra, "q": layer.q, "schedule": schedule, "mode": mode,
        "M": m, "K": k, "N": n, "dtype": "float32", "dense_path": dense_path,
        "dense_flinear_ms": round(times["F.linear"] * 1e3, 4),
        "dense_ms": round(t_dense * 1e3, 4), "algebra_ms": round(t_alg * 1e3, 4),
        "speedup": round(speedup, 4), "ideal": round(1 / float(rho), 4),
        "frac_of_ideal": round(speedup * float(rho), 4), "rho": str(rho),
        "types_present": len(part.present), "flushed": flushed,
        "cold": ("rotate" if rotating else "flush") if flushed else "",
        "copies": len(layers),
        "layout": _route_taken(algebra_fn),
        "partition_us": round(partition_us, 1), "trials": cfg.trials, **floor,
        # the modules' fixed cost per call: module time minus its bare kernel's
        "algebra_call_overhead_us": (round((t_alg - bare["bare algebra"]) * 1e6, 1)
                                     if bare else ""),
        "dense_call_overhead_us": (round((times["DecodeLinear"] - bare["bare dense"]) * 1e6, 1)
                                   if bare else ""),
    }


def _bare_kernels(x: torch.Tensor, layers: list[AlgebraLinear], part: object,
                  at: dict[str, Iterator[int]]) -> dict[str, Callable[[], object]]:
    """The compiled kernels called directly (no module, no binding, no checks in Python)
    on the same copies the modules read: what a layer call costs beyond its kernel."""
    mod = cpu_kernels.extension()
    plan = layers[0].plan
    tables = cpu_kernels.block_tables(plan)
    weights = [lay.weight.detach() for lay in layers]
    # keyed on the parameter itself: the very copies the modules' bound calls read
    typed = [cpu_kernels.typed_weight(lay.weight, plan) for lay in layers]
    types = part.types.to(torch.int64).contiguous()  # type: ignore[attr-defined]

    def bare_dense() -> object:
        return mod.dense_rows_forward(x, weights[next(at["bare dense"])], None)

    def bare_algebra() -> object:
        return mod.typed_rows_forward(x, typed[next(at["bare algebra"])], types, *tables,
                                      plan.q, None)

    return {"bare dense": bare_dense, "bare algebra": bare_algebra}


def _random_layer(k: int, n: int, algebra: str, gen: torch.Generator) -> AlgebraLinear:
    layer = AlgebraLinear(k, n, algebra, backend="blocked")
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
    return layer


def _copies(layer: AlgebraLinear, rotate_mib: int) -> int:
    """Copies of the layer whose weights alone hold at least ``rotate_mib`` MiB. With the
    arms staggered (:func:`_cycle`), a copy's weight is read again only after every other
    copy's: at least ``rotate_mib`` of other weights in between (the dense arms read the
    weight, the algebra arm its decode copy of it)."""
    w = layer.weight.detach()
    return max(1, -(-(rotate_mib << 20) // (w.numel() * w.element_size())))


def _cycle(n: int, start: int = 0) -> Iterator[int]:
    """``start, start + 1, ..., n - 1, 0, 1, ...`` forever."""
    return itertools.cycle([(start + i) % n for i in range(n)])


def run_layer_bench(cfg: LayerBenchConfig, out_prefix: str, progress: bool = True
                    ) -> list[dict[str, object]]:
    """Run the grid, write ``<out_prefix>.csv`` / ``.md`` / ``.png``; return the rows."""
    torch.set_num_threads(cfg.threads)
    env = environment()
    env.update(cfg.extra)
    flusher = CacheFlusher() if any(m <= cfg.flush_max_m for m in cfg.ms) else None
    grid = [("linear", m, k, n, a, s, mode) for (k, n) in cfg.shapes for m in cfg.ms
            for a in cfg.algebras for s in cfg.schedules for mode in cfg.modes]
    grid += [("swiglu", m, d, f, a, s, mode) for (d, f) in cfg.blocks for m in cfg.ms
             for a in cfg.algebras for s in cfg.schedules for mode in cfg.modes]
    rows: list[dict[str, object]] = []
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    stream = [stream_read_gbps()]  # the memory floor of this run, before and after
    peak = [gemm_peak_gflops()]  # and the compute ceiling
    bar = tqdm(grid, desc="layer bench", disable=not progress, unit="cfg")
    for kind, m, k, n, a, s, mode in bar:
        bar.set_postfix_str(f"{kind} M={m} {k}x{n} {a} {s} {mode}")
        if kind == "swiglu":
            row = time_swiglu_block(m, k, n, a, s, mode, cfg.trials, cfg.seed, flusher,
                                    cfg.flush_max_m)
        else:
            row = _time_one(cfg, m, k, n, a, s, mode, flusher)
        rows.append({**row, **{f"env_{key}": v for key, v in env.items()}})
        add_stream_columns(rows[-1:], stream)
        add_roofline_columns(rows[-1:], statistics.mean(stream), statistics.mean(peak))
        write_csv_atomic(out_prefix + ".csv", rows)  # partial results survive a stop
    stream.append(stream_read_gbps())
    peak.append(gemm_peak_gflops())
    add_stream_columns(rows, stream)
    add_roofline_columns(rows, statistics.mean(stream), statistics.mean(peak))
    write_csv_atomic(out_prefix + ".csv", rows)
    md = markdown_from_csv(out_prefix + ".csv")
    with open(out_prefix + ".md.tmp", "w") as fh:
        fh.write(md)
    os.replace(out_prefix + ".md.tmp", out_prefix + ".md")
    plot_from_csv(out_prefix + ".csv", out_prefix + ".png")
    return rows


def _read(csv_path: str) -> list[dict[str, str]]:
    with open(csv_path, newline="") as fh:
        return list(csv.DictReader(fh))


def markdown_from_csv(csv_path: str) -> str:
    """A Markdown table (and the environment) from a layer-bench CSV."""
    rows = _read(csv_path)
    if not rows:
        return "(no rows)\n"
    lines = [environment_line(rows), "",
             "The dense arm is the fastest dense path measured in the same interleaved "
             "trials (`F.linear`, or the project's dense few-row kernel at M ≤ "
             f"{DENSE_ARM_KERNEL_MAX_ROWS}, forward, called as a function or as the "
             "`DecodeLinear` module, whose calls cross into C++ bound like the algebra "
             "layer's; above that, forward, the panel kernel the algebra layer runs, on the "
             "dense weight's panel-packed copy); a row above 100% of the ideal is marked: "
             "against the fastest dense path it should not happen, and needs explaining.", "",
             "SwiGLU rows time the whole FFN block (gate, up, activation, down; K×N = D×F), "
             "the dense arm the fastest of three `F.linear`s, gate+up fused into one, and "
             "(a few rows, forward) the compiled SwiGLU kernel.", "",
             "Memory floor: the bytes each call must read and write (the weight blocks its "
             "rows' types use, the input and the output); bytes ideal = dense/algebra "
             "bytes; roofline = the dense arm's least time over the algebra arm's, each the "
             "slower of its bytes at the stream bandwidth and its flops at the float32 GEMM "
             "rate measured in the run"
             + (f" ({rows[0]['gemm_peak_gflops']} GFLOP/s)" if rows[0].get("gemm_peak_gflops")
                else "") + " (the bytes ideal where both are bound by bytes), and the "
             "speed-up as a share of it; GB/s achieved and "
             "its share of the stream read bandwidth measured in the same run"
             + (f" ({rows[0]['stream_read_gbps']} GB/s)" if rows[0].get("stream_read_gbps")
                else "") + ".", "",
             "| mode | M | K×N | algebra | schedule | dense path | dense ms | algebra ms | "
             "speed-up | ideal 1/ρ | % of ideal | roofline (% of it) | dense GB/s (% stream) | "
             "algebra GB/s (% stream) | layout |",
             "|---|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        flush = ""
        if r["flushed"] == "True":  # older CSVs have no cold column: they flushed
            flush = (f" (cold: {r['copies']} copies)" if r.get("cold") == "rotate"
                     else " (flushed)")
        frac = float(r["frac_of_ideal"])
        mark = " ⚠ above ideal" if frac > 1.0 else ""
        block = " SwiGLU" if r.get("kind") == "swiglu" else ""
        lines.append(
            f"| {r['mode']}{flush} | {r['M']} | {r['K']}×{r['N']}{block} | {r['algebra']} | "
            f"{r['schedule']} | {r.get('dense_path', 'F.linear')} | "
            f"{float(r['dense_ms']):.3f} | {float(r['algebra_ms']):.3f} | "
            f"{float(r['speedup']):.2f}× | {float(r['ideal']):.2f}× | "
            f"{100 * frac:.0f}%{mark} | {_floor_cells(r)} | {r['layout']} |")
    over = [r for r in rows if r.get("algebra_call_overhead_us")]
    if over:
        lines += ["", "Fixed cost of a module call over its bare compiled kernel (the same "
                  "copies, called directly), µs: " + "; ".join(
                      f"M = {r['M']} {r['algebra']}: algebra layer "
                      f"{float(r['algebra_call_overhead_us']):.0f}, `DecodeLinear` "
                      f"{float(r['dense_call_overhead_us']):.0f}" for r in over) + "."]
    return "\n".join(lines) + "\n"


def _floor_cells(r: dict[str, str]) -> str:
    """The roofline and GB/s cells of a row (dashes for a CSV written without them)."""
    if not r.get("roofline_ideal"):
        return "— | — | —"
    share = float(r["speedup"]) / float(r["roofline_ideal"])
    slow = " ⚠ dense off its floor" if share > 1.0 else ""
    return (f"{float(r['roofline_ideal']):.2f}× ({100 * share:.0f}%{slow}) | "
            f"{float(r['dense_gbps']):.1f} "
            f"({float(r['dense_pct_of_stream']):.0f}%) | {float(r['algebra_gbps']):.1f} "
            f"({float(r['algebra_pct_of_stream']):.0f}%)")


def plot_from_csv(csv_path: str, png_path: str) -> None:
    """Measured vs ideal speed-up (log–log), one panel per mode, from the CSV."""
    from structlm.plotting import pyplot

    plt = pyplot()

    rows = _read(csv_path)
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 5), squeeze=False)
    ms = sorted({int(r["M"]) for r in rows})
    shapes = sorted({(int(r["K"]), int(r["N"]), r.get("kind", "linear")) for r in rows})
    markers = "osD^v<>"
    cmap = plt.get_cmap("viridis", max(2, len(ms)))
    for ax, mode in zip(axes[0], modes, strict=True):
        sub = [r for r in rows if r["mode"] == mode]
        hi = max(max(float(r["ideal"]), float(r["speedup"])) for r in sub) * 1.3
        ax.plot([0.5, hi], [0.5, hi], "k--", lw=1, label="ideal 1/ρ")
        ax.axhline(1.0, color="grey", lw=0.8)
        for i, m in enumerate(ms):
            for j, shape in enumerate(shapes):
                pts = [r for r in sub if int(r["M"]) == m
                       and (int(r["K"]), int(r["N"]), r.get("kind", "linear")) == shape]
                if not pts:
                    continue
                ax.scatter([float(r["ideal"]) for r in pts], [float(r["speedup"]) for r in pts],
                           color=cmap(i), marker=markers[j % len(markers)],
                           label=f"M={m}, {shape[0]}×{shape[1]}"
                           + (" SwiGLU" if shape[2] == "swiglu" else ""))
                for r in pts:
                    ax.annotate(r["algebra"], (float(r["ideal"]), float(r["speedup"])),
                                fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("ideal speed-up 1/ρ")
        ax.set_ylabel("measured speed-up (dense / algebra)")
        ax.set_title(f"AlgebraLinear (blocked) vs the fastest dense path — {mode}")
        ax.legend(fontsize=7)
    env = {k[4:]: v for k, v in rows[0].items() if k.startswith("env_")}
    fig.suptitle(f"{env.get('cpu', '')}, torch {env.get('torch', '')}, "
                 f"{env.get('threads', '')} threads", fontsize=9)
    fig.tight_layout()
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, png_path)


def config_from_args(preset: str, **overrides: object) -> LayerBenchConfig:
    """A preset with command-line overrides (``None`` values are ignored)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: expected one of {sorted(PRESETS)}")
    kw = {k: v for k, v in overrides.items() if v is not None}
    return replace(PRESETS[preset], **kw)


def _route_taken(fn: Callable[[], object]) -> str:
    """The route the algebra layer's call in ``fn`` takes (recorded by the route itself)."""
    with trace() as records:
        fn()
    routes = {r.decision.route.value for r in records if type(r.call) is AlgebraCall}
    return "/".join(sorted(routes))
