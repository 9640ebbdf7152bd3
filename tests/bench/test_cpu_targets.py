"""benchmarks/cpu_targets.py: the committed targets table is what the committed CSVs give,
and each rule decides at its threshold (met / missed / not decidable), with bad input named."""

from __future__ import annotations

import csv
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _module():
    spec = importlib.util.spec_from_file_location("cpu_targets", ROOT / "benchmarks" /
                                                  "cpu_targets.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cpu_targets"] = mod  # dataclasses look their module up while building
    spec.loader.exec_module(mod)
    return mod


def test_the_committed_table_is_what_the_committed_csvs_give(tmp_path) -> None:
    ct = _module()
    ct.main(["--results", str(RESULTS), "--out", str(tmp_path / "t")])
    assert (tmp_path / "t.md").read_text() == (RESULTS / "cpu_targets.md").read_text()
    with (tmp_path / "t.csv").open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(ct.TARGETS)
    assert {r["status"] for r in rows} <= {"met", "missed", "not decidable"}


def test_the_docs_show_the_generated_table() -> None:
    gen = (RESULTS / "cpu_targets.md").read_text()
    table = gen[gen.index("| target |"):gen.index("\nCommands:")].strip()
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert table.replace("](", "](../benchmarks/results/") in docs


def _layer_row(algebra: str, m: int, speedup: float, roofline: float, **kw: str) -> dict:
    return {"kind": "linear", "algebra": algebra, "mode": "fwd", "M": str(m), "K": "4096",
            "N": "4096", "speedup": str(speedup), "roofline_ideal": str(roofline),
            "dense_path": "DecodeLinear", "dense_pct_of_stream": "47.0",
            "dense_macs": "536870912", "dense_ms": "5.5", "gemm_peak_gflops": "204.9", **kw}


def test_rules_at_their_thresholds() -> None:
    ct = _module()
    m1 = [_layer_row("Q4", 1, 1.9, 2.28, algebra_pct_of_stream="80.0",
                     algebra_call_overhead_us="20.0"),
          _layer_row("Q16", 1, 6.0, 8.2, algebra_pct_of_stream="79.9",
                     algebra_call_overhead_us="")]
    with pytest.raises(ValueError, match=r"\['Q2', 'Q8', 'Q32'\] are missing"):
        ct._m1_floor(m1)  # the target covers every q
    m1 += [_layer_row(q, 1, 1.0, 1.2, algebra_pct_of_stream="85", dense_pct_of_stream="99")
           for q in ("Q2", "Q8", "Q32")]
    v = ct._m1_floor(m1)
    assert v.status == "missed" and v.detail.startswith("below 80%: Q16;")
    m1[1]["algebra_pct_of_stream"] = "80.0"
    assert ct._m1_floor(m1).status == "met"
    assert "bare kernel" not in ct._m1_floor(m1).detail  # the bare calls were not timed
    for r in m1:  # 1 ms, of which 0.2 ms call cost, for 32 MB: the bare kernel at 40 GB/s
        r.update(algebra_ms="1.0", algebra_call_overhead_us="200", algebra_bytes="3.2e7",
                 dense_gbps="50")
    assert "bare kernel (less the module's call cost) at Q4 80%" in ct._m1_floor(m1).detail
    for r in m1:
        r["algebra_call_overhead_us"] = "20.0"
    m1[1]["algebra_call_overhead_us"] = ""
    assert ct._call_overhead(m1).status == "met"  # 20.0 is within; blank rows are skipped
    noisy = [_layer_row("Q4", 1, 1.0, 1.0, algebra_call_overhead_us="30",
                        dense_call_overhead_us="-5")]
    v = ct._call_overhead(noisy)  # the dense arm's own cost below zero: noise dominates
    assert v.status == "not decidable" and "noise" in v.detail
    m32 = [_layer_row("Q2", 32, 0.99, 1.0), _layer_row("Q4", 32, 0.85, 1.0)]
    assert ct._m32_roofline(m32).status == "met"
    # above the roofline: not decidable, the reason named; the shares against floors
    # raised to what the run achieved are given for information
    fast = dict(algebra_pct_of_stream="104", stream_read_gbps="35.0", dense_gbps="12.2",
                algebra_gbps="36.4", dense_bytes="67108864", algebra_bytes="67108864",
                ideal="4.27", algebra_ms="2.7")
    above = ct._m32_roofline([_layer_row("Q2", 32, 0.99, 1.0, **fast),
                              _layer_row("Q8", 32, 1.2, 1.0, **fast)])
    assert above.status == "not decidable"
    assert above.detail.startswith("Q8 above the roofline: a floor measured beside the run "
                                   "was below what the run achieved")
    assert "stream 36.4 GB/s" in above.detail and "Q8 " in above.detail.split("GFLOP/s): ")[1]
    slow = dict(fast, algebra_gbps="30.0", dense_gbps="5.0", dense_ms="11.1")
    v = ct._m32_roofline([_layer_row("Q8", 32, 1.2, 1.0, **slow)])
    assert v.status == "not decidable" and "the dense arm is off its own floor" in v.detail
    unsteady = dict(fast, stream_read_gbps_before_after="57.0;34.3")
    v = ct._m32_roofline([_layer_row("Q8", 32, 1.2, 1.0, **unsteady),
                          _layer_row("Q4", 32, 0.5, 1.0, **unsteady)])
    assert v.status == "not decidable" and "changed state" in v.detail
    v = ct._m32_roofline([_layer_row("Q2", 32, 0.84, 1.0)])
    assert v.status == "missed" and v.measured == "Q2 84.0%"
    # 2 x 536870912 flops in 5.5 ms at a 204.9 GFLOP/s GEMM rate: 95%
    assert v.detail == ("below 85%: Q2; the dense arm at up to 95% of the GEMM rate and 47% "
                        "of the stream measured in the run")
    gen = [{"model": "dense", "tokens_per_s": "40"},
           {"model": "llama.cpp f32", "tokens_per_s": "40", "greedy_tokens_equal_reference":
            "128/128"},
           {"model": "algebra", "tokens_per_s": "52", "ideal_mac_speedup": "1.5",
            "ideal_bytes_speedup": "1.45", "speedup_vs_dense": "1.305"}]
    assert ct._dense_vs_llamacpp(gen).status == "met"  # equal speed meets "≥"
    v = ct._algebra_vs_llamacpp(gen)  # 1.30× llama.cpp; 1.305 / 1.45 (the tighter) = 90%
    assert v.status == "met" and "of 1.450×" in v.measured
    gen[2]["tokens_per_s"] = "51.9"
    assert ct._algebra_vs_llamacpp(gen).status == "missed"



def test_a_floor_that_moved_decides_nothing() -> None:
    """A share of the stream needs the stream: a run whose stream read moved by more than
    1.2x between its start and end, or (M = 1) whose dense arm read above 110% of it, is
    not decidable; at the limits it still decides."""
    ct = _module()
    m1 = [_layer_row(q, 1, 1.0, 1.2, algebra_pct_of_stream="85", dense_pct_of_stream="110",
                     stream_read_gbps_before_after="30.0;36.0")
          for q in ("Q2", "Q4", "Q8", "Q16", "Q32")]
    assert ct._m1_floor(m1).status == "met"  # 1.2x and 110% are within
    m1[0]["stream_read_gbps_before_after"] = "30.0;36.1"
    v = ct._m1_floor(m1)
    assert v.status == "not decidable" and "30.00 and 36.10 GB/s" in v.detail
    assert v.measured.startswith("Q2 85%")
    m1[0]["stream_read_gbps_before_after"] = "30.0;36.0"
    m1[2]["dense_pct_of_stream"] = "110.1"
    v = ct._m1_floor(m1)
    assert v.status == "not decidable" and "up to 110.1% of the stream" in v.detail
    m32 = [_layer_row("Q2", 32, 0.5, 1.0, stream_read_gbps_before_after="57.0;34.3")]
    v = ct._m32_roofline(m32)
    assert v.status == "not decidable" and "57.00 and 34.30 GB/s" in v.detail


def test_bad_input_is_named(tmp_path) -> None:
    ct = _module()
    with pytest.raises(ValueError, match="expected one row"):
        ct._dense_vs_llamacpp([{"model": "dense", "tokens_per_s": "1"}])
    share = {"phase": "decode", "batch": "1", "speedup": "1.19",
             "original_bytes_per_step": "1320", "compressed_bytes_per_step": "1000"}
    assert ct._share_decode([share]).status == "met"  # 1.19 / 1.32 = 90.2%
    assert ct._share_decode([{**share, "speedup": "1.18"}]).status == "missed"
    with pytest.raises(ValueError, match="column 'speedup' is empty"):
        ct._share_decode([{**share, "speedup": ""}])
    with pytest.raises(ValueError, match="no training-step rows"):
        ct._train_step([])
    with pytest.raises(ValueError, match="no M = 1 row has"):
        ct._call_overhead([_layer_row("Q4", 1, 1.0, 1.0, algebra_call_overhead_us="")])
    with pytest.raises(ValueError, match="no linear fwd rows at M = 32"):
        ct._m32_roofline([])
    partial = tmp_path / "results"
    partial.mkdir()
    shutil.copy(RESULTS / "layer_cpu_small_cold.csv", partial)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ct.evaluate(partial)
    with pytest.raises(SystemExit):
        ct.main(["--results", str(tmp_path / "nowhere")])


def test_share_rules() -> None:
    """bench share rows: the decode speed-up against the bytes ideal (above it: the
    original is off its floor, not decidable) and the original against llama.cpp f32."""
    ct = _module()
    decode = {"phase": "decode", "batch": "1", "original_bytes_per_step": "132",
              "compressed_bytes_per_step": "100", "original_pct_of_stream": "52.0"}
    assert ct._share_decode([{**decode, "speedup": "1.19"}]).status == "met"  # 90.2%
    assert ct._share_decode([{**decode, "speedup": "1.18"}]).status == "missed"
    v = ct._share_decode([{**decode, "speedup": "1.40"}])
    assert v.status == "not decidable" and "52% of the stream" in v.detail
    peer = {"phase": "peer", "item": "llamacpp-f32", "original_tok_s": "56.2",
            "peer_tok_s": "68.7", "original_over_peer": "0.818",
            "peer_greedy_agreement": "32/32"}
    v = ct._share_dense_vs_llamacpp([peer])
    assert v.status == "missed" and v.measured == "56.20 vs 68.70 tok/s, 0.82×"
    assert ct._share_dense_vs_llamacpp([{**peer, "original_over_peer": "1.0"}]).status == "met"
    with pytest.raises(ValueError):
        ct._share_dense_vs_llamacpp([decode])  # no peer row
