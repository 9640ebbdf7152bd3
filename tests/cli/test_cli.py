"""The command line: algebra facts as JSON and text, the table, the layer bench."""

from __future__ import annotations

import csv
import json
import os
from fractions import Fraction

import pytest

from structlm.bench.layer import LayerBenchConfig, run_layer_bench
from structlm.cli import main

Q_OF = {"Q2": 2, "Q2^2": 4}
INFO_KEYS = {"name", "dim", "t", "rank_lower_bound", "explicit_products", "exact_rank",
             "rank_interval", "mac_ratio", "associative", "has_unit"}


def test_info_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["algebra", "info", "Q4", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert INFO_KEYS <= facts.keys()
    assert facts["mac_ratio"] == "7/16" and facts["exact_rank"] == 28 and facts["t"] == 4
    assert main(["algebra", "info", "Q2^2", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["exact_rank"] is None and facts["rank_interval"] == [28, 36]
    assert facts["mac_ratio"] == "9/16" and facts["associative"] and facts["has_unit"]


def test_info_text_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["algebra", "info", "graph:3:0-1,1-2,2-0"]) == 0
    out = capsys.readouterr().out
    assert "explicit_products" in out and "dead_blocks        3" in out
    assert main(["algebra", "info", "Q0"]) == 2
    assert "Q<q> needs 1 <= q" in capsys.readouterr().err


def test_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["algebra", "table"]) == 0
    out = capsys.readouterr().out
    assert "| Q2 | 2 | 4 | 2 | 6 | 6 | 3/4 | 6 |" in out
    assert "| Q4 | 4 | 16 | 4 | 28 | 28 | 7/16 | 28 |" in out
    assert "| Q2^2 | 4 | 16 | 4 | 36 | 36 | 9/16 | only known in [28, 36] |" in out


def test_layer_bench_writes_csv_md_png(tmp_path: os.PathLike[str]) -> None:
    cfg = LayerBenchConfig(ms=(1, 8), shapes=((32, 16),), algebras=("Q2", "Q2^2"),
                           schedules=("cyclic", "block"), modes=("fwd", "fwdbwd"), trials=1,
                           threads=1, flush_max_m=0)
    prefix = os.path.join(tmp_path, "lb")
    rows = run_layer_bench(cfg, prefix, progress=False)
    assert len(rows) == 2 * 2 * 2 * 2
    with open(prefix + ".csv") as fh:
        read = list(csv.DictReader(fh))
    assert len(read) == len(rows)
    for r in read:
        assert float(r["dense_ms"]) > 0 and float(r["algebra_ms"]) > 0
        assert r["env_torch"] and r["env_cpu"]
    block_m8 = next(r for r in read if r["schedule"] == "block" and r["M"] == "8")
    assert block_m8["types_present"] == "1" and block_m8["rho"] in {"3/4", "9/16"}
    assert "| fwd | 8 | 32×16 |" in open(prefix + ".md").read()
    # the memory floor: one type reads rho of the weight, every type together all of it
    for r in read:
        m, k, n = int(r["M"]), int(r["K"]), int(r["N"])
        passes = 1 if r["mode"] == "fwd" else 3
        assert int(r["dense_bytes"]) == passes * 4 * (k * n + m * k + m * n)
        if r["types_present"] == "1":
            used = Fraction(r["rho"]) * k * n
        else:
            assert int(r["types_present"]) == Q_OF[r["algebra"]]
            used = k * n  # every block of Q2 / Q2^2 is used by some type
        assert int(r["algebra_bytes"]) == passes * 4 * (used + m * k + m * n)
        stream, peak = float(r["stream_read_gbps"]), float(r["gemm_peak_gflops"])
        dense_macs = passes * m * k * n
        assert int(r["dense_macs"]) == dense_macs
        floors = [max(int(r[f"{arm}_bytes"]) / (stream * 1e9), 2 * macs / (peak * 1e9))
                  for arm, macs in (("dense", dense_macs),
                                    ("algebra", dense_macs / float(r["ideal"])))]
        assert float(r["roofline_ideal"]) == pytest.approx(floors[0] / floors[1], rel=1e-3)
        assert stream > 0
        for arm in ("dense", "algebra"):  # bytes / median seconds
            ms = float(r[f"{arm}_ms"])  # written to 4 decimals: up to 5e-5 ms off
            assert float(r[f"{arm}_gbps"]) == pytest.approx(
                int(r[f"{arm}_bytes"]) / (ms / 1e3) / 1e9, rel=1e-3 + 6e-5 / ms, abs=2e-6)
        for arm in ("dense", "algebra"):
            pct = 100 * float(r[f"{arm}_gbps"]) / stream
            assert abs(float(r[f"{arm}_pct_of_stream"]) - pct) <= 0.05 + 1e-3 * pct
    assert os.path.getsize(prefix + ".png") > 1000
    # the dense arm is the fastest dense path of the run: at M = 1 forward the project's
    # dense few-row kernel competes with F.linear (when built), never slower than F.linear
    from structlm.ops import cpu_kernels

    for r in read:
        assert float(r["dense_ms"]) <= float(r["dense_flinear_ms"])
        few_rows_fwd = int(r["M"]) <= 32 and r["mode"] == "fwd"
        expected = ({"F.linear", "dense-rows kernel", "DecodeLinear"}
                    if few_rows_fwd and cpu_kernels.fused_rows_available() else {"F.linear"})
        assert r["dense_path"] in expected, r


def test_layer_bench_cold_rows_rotate_copies(tmp_path: os.PathLike[str]) -> None:
    """Cold forward rows run each arm on the next of enough copies of the layer for the
    weights to hold rotate_mib; forward + backward rows flush."""
    from dataclasses import replace

    cfg = LayerBenchConfig(ms=(1,), shapes=((64, 32),), algebras=("Q2^2",),
                           schedules=("cyclic",), modes=("fwd", "fwdbwd"), trials=2,
                           threads=1, flush_max_m=1, rotate_mib=1)
    rows = run_layer_bench(cfg, os.path.join(tmp_path, "cold"), progress=False)
    fwd, bwd = rows
    assert fwd["cold"] == "rotate" and fwd["copies"] == (1 << 20) // (64 * 32 * 4) == 128
    assert bwd["cold"] == "flush" and bwd["copies"] == 1 and bwd["flushed"]
    from structlm.ops import cpu_kernels

    if cpu_kernels.fused_rows_available():  # module time minus the bare kernel's
        assert isinstance(fwd["algebra_call_overhead_us"], float)
        assert isinstance(fwd["dense_call_overhead_us"], float)
        assert bwd["algebra_call_overhead_us"] == ""
    md = open(os.path.join(tmp_path, "cold.md")).read()
    assert f"fwd (cold: {fwd['copies']} copies) | 1 |" in md and "fwdbwd (flushed)" in md
    flush = run_layer_bench(replace(cfg, cold="flush", modes=("fwd",)),
                            os.path.join(tmp_path, "flush"), progress=False)
    assert flush[0]["cold"] == "flush" and flush[0]["copies"] == 1


def test_layer_bench_swiglu_rows_and_shape_checks(tmp_path: os.PathLike[str]) -> None:
    """SwiGLU block rows: the model's algebra FFN against the fastest of the dense block
    paths, with the block's MAC ideal; shapes a q does not divide are refused up front."""
    from fractions import Fraction

    from structlm.bench.swiglu_block import time_swiglu_block

    for mode in ("fwd", "fwdbwd"):
        for m in (1, 7):
            r = time_swiglu_block(m, 48, 100, "Q4", "cyclic", mode, 1, 0, None, 0)
            assert r["kind"] == "swiglu" and r["K"] == 48 and r["N"] == 100
            paths = {"F.linear x3", "F.linear gate+up fused", "swiglu kernel",
                     "dense-rows kernel x3"}
            assert r["dense_path"] in paths and r["dense_ms"] <= r["dense_flinear_ms"]
            present = min(m, 4)  # cyclic types 0..m-1 (Q4: one row per type up to 4)
            assert r["types_present"] == present
            rho = Fraction(r["rho"])
            assert 0 < rho < 1 and r["ideal"] == pytest.approx(float(1 / rho), 1e-3)
    cfg = LayerBenchConfig(ms=(4,), shapes=(), blocks=((8, 12),), algebras=("Q2",),
                           schedules=("cyclic",), modes=("fwd",), trials=1, threads=1)
    rows = run_layer_bench(cfg, os.path.join(tmp_path, "sw"), progress=False)
    assert [r["kind"] for r in rows] == ["swiglu"]
    assert "8×12 SwiGLU" in open(os.path.join(tmp_path, "sw.md")).read()
    with pytest.raises(ValueError, match=r"blocks \['8x10'\].*q=4"):
        LayerBenchConfig(blocks=((8, 10),), algebras=("Q4",))
    with pytest.raises(ValueError, match=r"shapes \['97x64'\]"):
        LayerBenchConfig(shapes=((97, 64),), algebras=("Q2^2",))


def test_layer_bench_dense_packed_arm_packs_each_copy_once(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Above 32 rows the dense arm runs the packed kernel: its panel-packed copy is made
    once per weight copy, not per call (a per-call ``.detach()`` would miss the cache,
    which is keyed on the tensor object, and time the packing too)."""
    from structlm.ops import cpu_kernels
    from structlm.ops.route import paired_panels

    if not cpu_kernels.fused_rows_available():
        pytest.skip("the compiled kernel is not built here")
    if not paired_panels():  # 32 rows per type: the kernel's route only with AVX-512 loops
        pytest.skip("the compiled kernel has no AVX-512 paired-panel loops on this CPU")
    dense_packs = []
    real = cpu_kernels._strips

    def spy(w: object, out_offsets: tuple[int, ...]) -> object:
        if len(out_offsets) == 2:  # one output group: a dense weight (Q2 has two)
            dense_packs.append(1)
        return real(w, out_offsets)

    monkeypatch.setattr(cpu_kernels, "_strips", spy)
    for trials, cold in ((3, "flush"), (9, "flush"), (3, "rotate")):
        dense_packs.clear()
        cfg = LayerBenchConfig(ms=(64,), shapes=((64, 32),), algebras=("Q2",),
                               schedules=("cyclic",), modes=("fwd",), trials=trials,
                               threads=1, flush_max_m=64, cold=cold, rotate_mib=1)
        rows = run_layer_bench(cfg, os.path.join(tmp_path, f"p{trials}{cold}"),
                               progress=False)
        copies = rows[0]["copies"]
        assert (copies > 1) == (cold == "rotate") and rows[0]["layout"] == "fused-rows"
        assert len(dense_packs) == copies, f"{len(dense_packs)} packs, {copies} copies"
