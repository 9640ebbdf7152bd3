"""Where each CPU speed target stands, computed from the committed benchmark CSVs.

    python benchmarks/cpu_targets.py [--results benchmarks/results] [--out PREFIX]

Every target of the CPU performance work is a rule fixed before the runs (a threshold on
a ratio measured in one interleaved run); this script reads the CSV each one is decided
by, applies the rule and writes ``PREFIX.md`` and ``PREFIX.csv`` (default
``benchmarks/results/cpu_targets``): the measured values, met / missed / not decidable,
and the source file, so the table in docs/benchmarks.md is never typed by hand. Nothing
is timed here. A target is *not decidable* when a measured speed-up exceeds its ideal
(M = 32: the roofline, the slower of bytes and flops at the run's measured stream and
GEMM rates; a compressed model's decode: its bytes ideal): the baseline is then off its
own floor (the fairness rule), so the ratio says more about the baseline than about the
method; and the call cost is not decidable when the dense arm's own call cost, measured
the same way, reads below zero (noise). Shares print rounded down.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from structlm.bench.bandwidth import roofline_seconds

Row = dict[str, str]


@dataclass(frozen=True)
class Verdict:
    """One target's outcome: what was measured, whether it meets the rule, and why."""

    measured: str
    status: str  # "met", "missed" or "not decidable"
    detail: str = ""


@dataclass(frozen=True)
class Target:
    """A speed target: its rule in words, the CSV deciding it and the rule as code."""

    name: str
    source: str
    command: str
    decide: Callable[[list[Row]], Verdict]


def _f(row: Row, key: str) -> float:
    value = row.get(key, "")
    if value == "":
        raise ValueError(f"column {key!r} is empty in row {row}")
    return float(value)


def _one(rows: list[Row], what: str, **match: str) -> Row:
    hits = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(hits) != 1:
        raise ValueError(f"{what}: expected one row with {match}, found {len(hits)}")
    return hits[0]


def _status(ok: bool) -> str:
    return "met" if ok else "missed"


def _share(f: float) -> str:
    """A share as a whole percentage rounded down, so a value just under a threshold
    never prints as the threshold (0.796 -> "79%")."""
    return f"{math.floor(round(100 * f, 6))}%"


def _dense_vs_llamacpp(rows: list[Row]) -> Verdict:
    dense = _one(rows, "dense arm", model="dense")
    peer = _one(rows, "llama.cpp f32 arm", model="llama.cpp f32")
    ratio = _f(dense, "tokens_per_s") / _f(peer, "tokens_per_s")
    return Verdict(f"{_f(dense, 'tokens_per_s'):.2f} vs {_f(peer, 'tokens_per_s'):.2f} tok/s, "
                   f"{ratio:.2f}×", _status(ratio >= 1.0),
                   f"greedy tokens equal: {peer.get('greedy_tokens_equal_reference', '?')}")


def _algebra_vs_llamacpp(rows: list[Row]) -> Verdict:
    alg = _one(rows, "algebra arm", model="algebra")
    peer = _one(rows, "llama.cpp f32 arm", model="llama.cpp f32")
    over_peer = _f(alg, "tokens_per_s") / _f(peer, "tokens_per_s")
    ideal = min(_f(alg, "ideal_mac_speedup"), _f(alg, "ideal_bytes_speedup"))
    share = _f(alg, "speedup_vs_dense") / ideal
    return Verdict(f"{over_peer:.2f}× llama.cpp; {_f(alg, 'speedup_vs_dense'):.3f}× of "
                   f"{ideal:.3f}× = {_share(share)}", _status(over_peer >= 1.3 and share >= 0.9))


def _share_decode(rows: list[Row]) -> Verdict:
    """≥ 90% of the bytes ideal; a speed-up above the ideal means the original (the
    baseline) is off its own floor, so the ratio decides nothing (the fairness rule)."""
    r = _one(rows, "decode at batch 1", phase="decode", batch="1")
    ideal = _f(r, "original_bytes_per_step") / _f(r, "compressed_bytes_per_step")
    share = _f(r, "speedup") / ideal
    text = f"{_f(r, 'speedup'):.3f}× of {ideal:.3f}× = {_share(share)}"
    if share > 1.0:
        return Verdict(text, "not decidable",
                       f"above the bytes ideal: the original reads at "
                       f"{_f(r, 'original_pct_of_stream'):.0f}% of the stream, off its floor")
    return Verdict(text, _status(share >= 0.9),
                   "bytes per step: weights read once and the KV cache")


def _share_dense_vs_llamacpp(rows: list[Row]) -> Verdict:
    """The original model's decode (the project's dense path) against llama.cpp f32 in the
    batch-1 decode trials of ``bench share --peers``."""
    peer = _one(rows, "llama.cpp f32 peer row", phase="peer", item="llamacpp-f32")
    ratio = _f(peer, "original_over_peer")
    return Verdict(f"{_f(peer, 'original_tok_s'):.2f} vs {_f(peer, 'peer_tok_s'):.2f} tok/s, "
                   f"{ratio:.2f}×", _status(ratio >= 1.0),
                   f"greedy tokens equal: {peer.get('peer_greedy_agreement', '?')}")


def _generate_ideal(rows: list[Row]) -> Verdict:
    alg = _one(rows, "algebra arm", model="algebra")
    ideal = min(_f(alg, "ideal_mac_speedup"), _f(alg, "ideal_bytes_speedup"))
    share = _f(alg, "speedup_vs_dense") / ideal
    return Verdict(f"{_f(alg, 'speedup_vs_dense'):.3f}× of {ideal:.3f}× = {_share(share)}",
                   _status(share >= 0.9))


EVERY_Q = ("Q2", "Q4", "Q8", "Q16", "Q32")


def _layer_rows(rows: list[Row], m: int, mode: str = "fwd", square: int | None = None
                ) -> list[Row]:
    sel = [r for r in rows if r.get("kind") == "linear" and r.get("M") == str(m)
           and r.get("mode") == mode
           and (square is None or r.get("K") == r.get("N") == str(square))]
    if not sel:
        raise ValueError(f"no linear {mode} rows at M = {m}"
                         + (f", {square}×{square}" if square else ""))
    return sel


def _every_q(sel: list[Row]) -> None:
    missing = [q for q in EVERY_Q if q not in {r["algebra"] for r in sel}]
    if missing:
        raise ValueError(f"the target covers every q: rows for {missing} are missing")


def _bare_kernel(sel: list[Row]) -> str:
    """Where an M = 1 row's time goes: the bare compiled kernel's GB/s (the module's time
    less its measured call cost) over the dense arm's GB/s in the same row."""
    cells = []
    needed = ("algebra_ms", "algebra_call_overhead_us", "algebra_bytes", "dense_gbps")
    for r in sel:
        if any(r.get(k, "") == "" for k in needed):  # a run without the bare calls timed
            return ""
        bare_s = (_f(r, "algebra_ms") - _f(r, "algebra_call_overhead_us") / 1e3) / 1e3
        bare_gbps = _f(r, "algebra_bytes") / bare_s / 1e9
        cells.append(f"{r['algebra']} {_share(bare_gbps / _f(r, 'dense_gbps'))}")
    return "; the bare kernel (less the module's call cost) at " + ", ".join(cells) + (
        " of the dense arm's GB/s in the same row")


#: the stream bandwidth read before and after a run may differ by this factor at most;
#: beyond it the floor a share is taken of was not one number during the run
STEADY_STREAM = 1.2


#: a dense arm reading above this share of the stream bandwidth (%) means the floor
#: measured beside the run is below the machine's during the timings
DENSE_ABOVE_STREAM = 110


def _unsteady_stream(sel: list[Row]) -> str:
    """Why a run's floor is unknown (the stream bandwidth measured before and after a run
    of these rows differs by more than STEADY_STREAM), or "" where it held."""
    for r in sel:
        values = [float(v) for v in str(r.get("stream_read_gbps_before_after", "")).split(";")
                  if v]
        if len(values) >= 2 and max(values) > STEADY_STREAM * min(values):
            return (f"the stream bandwidth measured before and after the run reads "
                    f"{' and '.join(f'{v:.2f}' for v in values)} GB/s: the machine changed "
                    "state during the run, so its floor is not known")
    return ""


def _m1_floor(rows: list[Row]) -> Verdict:
    """The issue's rule: ≥ 80% of the stream read bandwidth measured in the run on the
    bytes the layer must read. Beside it, the share of the roofline ideal (the speed-up
    over the dense arm over the bytes ideal), which the dense arm's own reading bounds.
    Not decidable where the stream bandwidth moved during the run (_unsteady_stream)."""
    sel = _layer_rows(rows, 1, square=4096)
    _every_q(sel)
    unsteady = _unsteady_stream(sel)
    dense_top = max(_f(r, "dense_pct_of_stream") for r in sel)
    if not unsteady and dense_top > DENSE_ABOVE_STREAM:
        unsteady = (f"the dense arm reads at up to {dense_top:.1f}% of the stream bandwidth "
                    "measured beside the run: the machine ran faster during the timings "
                    "than when its floor was measured")
    if unsteady:
        text = ", ".join(f"{r['algebra']} {_share(_f(r, 'algebra_pct_of_stream') / 100)}"
                         for r in sel)
        return Verdict(text, "not decidable", unsteady)
    cells = [(r["algebra"], _f(r, "algebra_pct_of_stream"),
              _f(r, "speedup") / _f(r, "roofline_ideal")) for r in sel]
    low = [a for a, pct, _ in cells if pct < 80]
    dense = max(_f(r, "dense_pct_of_stream") for r in sel)
    detail = (f"below 80%: {', '.join(low)}; " if low else "") + (
        "of the roofline: " + ", ".join(f"{a} {_share(f)}" for a, _, f in cells)
        + f" (the dense arm at up to {dense:.0f}% of the stream)") + _bare_kernel(sel)
    return Verdict(", ".join(f"{a} {_share(pct / 100)}" for a, pct, _ in cells),
                   _status(not low),
                   detail)


def _call_overhead(rows: list[Row]) -> Verdict:
    """Within 20 µs at every M = 1 row. The dense arm's call cost, measured the same way
    in the same run, is the check on the measurement: a negative value there means the
    noise of the difference of two medians exceeds the microseconds being measured, and
    the rows decide nothing."""
    sel = [r for r in _layer_rows(rows, 1) if r.get("algebra_call_overhead_us", "") != ""]
    if not sel:
        raise ValueError("no M = 1 row has an algebra_call_overhead_us value")
    us = [_f(r, "algebra_call_overhead_us") for r in sel]
    text = f"{min(us):.0f}–{max(us):.0f} µs over {len(us)} rows"
    dense = [_f(r, "dense_call_overhead_us") for r in sel
             if r.get("dense_call_overhead_us", "") != ""]
    if dense and min(dense) < 0:
        return Verdict(text, "not decidable",
                       f"the dense arm's call cost in the same run reads {min(dense):.0f} to "
                       f"{max(dense):.0f} µs: the noise exceeds what is measured")
    over = [f"{r['algebra']} {r['K']}×{r['N']}" for r, u in zip(sel, us, strict=True) if u > 20]
    return Verdict(text, _status(not over),
                   f"over 20 µs: {len(over)} of {len(us)} rows" if over else "")


def _raised_floor_shares(sel: list[Row]) -> tuple[list[float], float, float]:
    """Each row's share of its roofline with both floors raised to the least values the
    run itself shows the machine had: the stream to the fastest read of any arm (if above
    the one measured beside the run), the GEMM rate to the fastest flops of any arm. Where
    a floor measured beside the run was below what an arm then achieved, these are the
    smallest corrections that make it a floor again (they can move a share either way: a
    faster stream raises a compute-bound dense arm's roofline over a bytes-bound algebra
    arm's, a faster GEMM rate lowers it). Returns the shares and the two raised floors."""
    stream = max(max(_f(r, "stream_read_gbps"), _f(r, "dense_gbps"), _f(r, "algebra_gbps"))
                 for r in sel)
    gemm = max(max(_f(r, "gemm_peak_gflops"),
                   2 * _f(r, "dense_macs") / (_f(r, "dense_ms") * 1e-3) / 1e9,
                   2 * _f(r, "dense_macs") / _f(r, "ideal") / (_f(r, "algebra_ms") * 1e-3) / 1e9)
               for r in sel)
    shares = []
    for r in sel:
        macs = _f(r, "dense_macs")
        dense = roofline_seconds(_f(r, "dense_bytes"), macs, stream, gemm)
        alg = roofline_seconds(_f(r, "algebra_bytes"), macs / _f(r, "ideal"), stream, gemm)
        shares.append(_f(r, "speedup") / (dense / alg))
    return shares, stream, gemm


def _m32_roofline(rows: list[Row]) -> Verdict:
    """≥ 85% of the roofline (the tighter of bytes and flops, floors measured in the run).
    Not decidable where the stream moved during the run, or where a row is above its
    roofline (a floor measured beside the run was below what the run achieved). For the
    latter the detail gives, for information only, the shares against floors raised to
    what the run achieved (_raised_floor_shares); they decide nothing."""
    sel = _layer_rows(rows, 32, square=4096)
    fracs = [(r["algebra"], _f(r, "speedup") / _f(r, "roofline_ideal")) for r in sel]
    above = [a for a, f in fracs if f > 1.0]
    dense = ", ".join(f"{p:.0f}%" for p in sorted({round(_f(r, "dense_pct_of_stream"))
                                                    for r in sel}))
    # one decimal, rounded down: a share just under 85% never prints as 85.0%
    text = ", ".join(f"{a} {math.floor(1000 * f) / 10:.1f}%" for a, f in fracs)
    unsteady = _unsteady_stream(sel)
    if unsteady:
        return Verdict(text, "not decidable", unsteady)
    # the dense arm's own place: its flops at the GEMM rate measured in the run
    rate = max(2 * _f(r, "dense_macs") / (_f(r, "dense_ms") * 1e-3) / 1e9
               / _f(r, "gemm_peak_gflops") for r in sel)
    if above:
        shares, stream, gemm = _raised_floor_shares(sel)
        raised = ", ".join(f"{r['algebra']} {math.floor(1000 * f) / 10:.1f}%"
                           for r, f in zip(sel, shares, strict=True))
        low_floor = (stream > max(_f(r, "stream_read_gbps") for r in sel)
                     or gemm > max(_f(r, "gemm_peak_gflops") for r in sel))
        why = ("a floor measured beside the run was below what the run achieved"
               if low_floor else "the dense arm is off its own floor")
        return Verdict(text, "not decidable",
                       f"{', '.join(above)} above the roofline: {why} (the dense arm at up "
                       f"to {rate:.0%} of the GEMM rate and {dense} of the stream); for "
                       f"information, against floors raised to what the run achieved "
                       f"(stream {stream:.1f} GB/s, GEMM {gemm:.1f} GFLOP/s): {raised}")
    low = [a for a, f in fracs if f < 0.85]
    return Verdict(text, _status(not low),
                   (f"below 85%: {', '.join(low)}; " if low else "")
                   + f"the dense arm at up to {rate:.0%} of the GEMM rate and {dense} of the "
                   "stream measured in the run")


def _large_q(rows: list[Row]) -> Verdict:
    sel = [r for r in _layer_rows(rows, 2048, square=4096) if r["algebra"] in ("Q16", "Q32")]
    if {r["algebra"] for r in sel} != {"Q16", "Q32"}:
        raise ValueError("Q16 and Q32 fwd rows at M = 2048, 4096×4096 are both needed")
    cells = [(r["algebra"], _f(r, "frac_of_ideal")) for r in sel]
    return Verdict(", ".join(f"{a} {_share(f)}" for a, f in cells),
                   _status(all(f >= 0.85 for _, f in cells)))


def _train_step(rows: list[Row]) -> Verdict:
    if not rows:
        raise ValueError("no training-step rows")
    cells = [(f"{r['preset']} batch {r['batch_size']}", _f(r, "speedup"), _f(r, "ideal"))
             for r in rows]
    return Verdict(", ".join(f"{n}: {s:.3f}× of {i:.3f}× = {_share(s / i)}"
                             for n, s, i in cells),
                   _status(all(s / i >= 0.9 for _, s, i in cells)))


TARGETS = (
    Target("dense decode of SmolLM2 f32 ≥ llama.cpp f32, same run (Xeon)",
           "generate_fused/smollm2_q2x2_all.csv",
           "structlm bench generate --model smollm2 --algebra Q2^2 --targets all "
           "--peers llamacpp-f32,llamacpp-q8_0 --modes fixed --max-new-tokens 128",
           _dense_vs_llamacpp),
    Target("dense decode of SmolLM2 f32 ≥ llama.cpp f32, same run (EPYC)",
           "generate_fused/smollm2_q2x2_all_epyc.csv",
           "structlm bench generate --model smollm2 --algebra Q2^2 --targets all "
           "--peers llamacpp-f32,llamacpp-q8_0 --modes fixed --max-new-tokens 128 --runs 7",
           _dense_vs_llamacpp),
    Target("dense decode of SmolLM2 f32 ≥ llama.cpp f32, `bench share` trials (EPYC)",
           "share_bench_smollm2_basis_sharing_all40_peers.csv",
           "structlm bench share smollm2 --compressed DIR/model --trials 7 "
           "--peers llamacpp-f32,llamacpp-q8_0", _share_dense_vs_llamacpp),
    Target("`Q2^2` on every linear ≥ 1.3× llama.cpp f32 and ≥ 90% of its ideal over dense "
           "(Xeon)", "generate_fused/smollm2_q2x2_all.csv", "(the same run)",
           _algebra_vs_llamacpp),
    Target("`Q2^2` on every linear ≥ 1.3× llama.cpp f32 and ≥ 90% of its ideal over dense "
           "(EPYC)", "generate_fused/smollm2_q2x2_all_epyc.csv", "(the same run)",
           _algebra_vs_llamacpp),
    Target("basis-sharing −40% decode (batch 1) ≥ 90% of its bytes ideal (Xeon)",
           "share_bench_smollm2_basis_sharing_all40_fused.csv",
           "structlm bench share smollm2 --compressed DIR/model --trials 7", _share_decode),
    Target("basis-sharing −40% decode (batch 1) ≥ 90% of its bytes ideal (EPYC)",
           "share_bench_smollm2_basis_sharing_all40_peers.csv",
           "(the same run as its dense vs llama.cpp row)", _share_decode),
    Target("StructLM decode (paper-110m, `Q2^2`) ≥ 90% of its ideal",
           "generate_cpu_paper110m_xeon.csv",
           "structlm bench generate --preset paper-110m --algebra Q2^2 --runs 4 "
           "--max-new-tokens 128 --modes fixed", _generate_ideal),
    Target("one layer at M = 1 ≥ 80% of the stream bandwidth, every q (4096², Xeon)",
           "layer_cpu_small_cold.csv",
           "structlm bench layer --preset small --modes fwd --schedules cyclic", _m1_floor),
    Target("one layer at M = 1 ≥ 80% of the stream bandwidth, every q (4096², EPYC)",
           "layer_cpu_small_m1_epyc.csv",
           "structlm bench layer --preset small --ms 1 --modes fwd --schedules cyclic",
           _m1_floor),
    Target("a module call within 20 µs of its bare kernel at M = 1 (4096², Xeon)",
           "layer_cpu_small_cold.csv", "(the same run)", _call_overhead),
    Target("a module call within 20 µs of its bare kernel at M = 1 (4096², EPYC)",
           "layer_cpu_small_m1_epyc.csv", "(the same run as its M = 1 row)", _call_overhead),
    Target("a module call within 20 µs of its bare kernel at M = 1 (SmolLM2's shapes, Xeon)",
           "layer_cpu_shapes_m1_cold.csv",
           "structlm bench layer --preset shapes --ms 1 --modes fwd --trials 21", _call_overhead),
    Target("a module call within 20 µs of its bare kernel at M = 1 (SmolLM2's shapes, EPYC)",
           "layer_cpu_shapes_m1_epyc.csv",
           "structlm bench layer --preset shapes --ms 1 --modes fwd --trials 21", _call_overhead),
    Target("M = 32 ≥ 85% of the tighter limit (4096², Xeon)",
           "layer_cpu_small_m32_xeon.csv",
           "structlm bench layer --preset small --ms 32 --modes fwd", _m32_roofline),
    Target("M = 32 ≥ 85% of the tighter limit (4096², EPYC)",
           "layer_cpu_small_m32_epyc.csv",
           "structlm bench layer --preset small --ms 32 --modes fwd", _m32_roofline),
    Target("`Q16`, `Q32` at M = 2048 ≥ 85% of the MAC ideal (4096², Xeon)",
           "layer_cpu_target_xeon.csv", "structlm bench layer --preset target", _large_q),
    Target("`Q16`, `Q32` at M = 2048 ≥ 85% of the MAC ideal (4096², EPYC)",
           "layer_cpu_target_epyc.csv",
           "structlm bench layer --preset target --modes fwd --trials 9", _large_q),
    Target("training step ≥ 90% of its ideal (study-cpu, Xeon)",
           "train_step_cpu_study_xeon.csv",
           "structlm bench train --preset study-cpu --trials 11 --profile", _train_step),
    Target("training step ≥ 90% of its ideal (study-cpu, EPYC)",
           "train_step_cpu_study_epyc.csv",
           "structlm bench train --preset study-cpu --trials 11 --profile", _train_step),
    Target("training step ≥ 90% of its ideal (paper-110m)",
           "train_step_cpu_paper110m.csv", "structlm bench train --preset paper-110m --trials 3",
           _train_step),
)


def _environment(rows: list[Row]) -> str:
    r = rows[0]
    cpu = r.get("env_cpu", "?")
    when = r.get("env_date") or r.get("env_time") or ""
    return f"{cpu}{', ' + when[:10] if when else ''}"


def evaluate(results: Path) -> list[dict[str, str]]:
    """One record per target: name, measured, status, detail, source, environment."""
    out = []
    for t in TARGETS:
        path = results / t.source
        if not path.is_file():
            raise FileNotFoundError(f"{t.name}: its source {path} does not exist")
        with path.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
        if not rows:
            raise ValueError(f"{t.name}: {path} has no rows")
        v = t.decide(rows)
        out.append({"target": t.name, "measured": v.measured, "status": v.status,
                    "detail": v.detail, "source": t.source, "environment": _environment(rows),
                    "command": t.command})
    return out


def markdown(records: list[dict[str, str]]) -> str:
    """The targets table (links relative to the results folder)."""
    lines = ["# Where each CPU speed target stands", "",
             "Written by `python benchmarks/cpu_targets.py` from the CSVs named in each row "
             "(nothing is timed by the script; each CSV's own Markdown gives its run).", "",
             "| target | measured | stands | why / where | source (machine, date) |",
             "|---|---|---|---|---|"]
    for r in records:
        stem = r["source"].removesuffix(".csv")
        lines.append(f"| {r['target']} | {r['measured']} | **{r['status']}** | "
                     f"{r['detail'] or '—'} | [{stem}]({stem}.md) ({r['environment']}) |")
    met = sum(r["status"] == "met" for r in records)
    lines += ["", f"{met} of {len(records)} met.", "", "Commands:", ""]
    lines += [f"- {r['source']}: `{r['command']}`" for r in records]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default="benchmarks/results", type=Path,
                    help="folder holding the benchmark CSVs")
    ap.add_argument("--out", default=None, help="output prefix (default RESULTS/cpu_targets)")
    args = ap.parse_args(argv)
    if not args.results.is_dir():
        ap.error(f"--results {str(args.results)!r} is not a folder")
    prefix = args.out or str(args.results / "cpu_targets")
    records = evaluate(args.results)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".md", markdown(records)), (".csv", None)):
        tmp = f"{prefix}{suffix}.tmp"
        with open(tmp, "w", newline="") as fh:
            if text is None:
                writer = csv.DictWriter(fh, fieldnames=list(records[0]))
                writer.writeheader()
                writer.writerows(records)
            else:
                fh.write(text)
        os.replace(tmp, prefix + suffix)
    print(markdown(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
