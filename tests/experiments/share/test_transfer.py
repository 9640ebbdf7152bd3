"""Test 8's side-by-side report on the committed SmolLM2 results: a model against itself
transfers every finding it separates; a changed verdict is called out."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from structlm.experiments.share.transfer import findings, load_results

ROOT = Path(__file__).resolve().parents[3]
ANALYSIS = ROOT / "benchmarks" / "results" / "share_smollm2_analysis"
EXPERIMENT = ROOT / "benchmarks" / "results" / "share_smollm2_experiment"


def test_a_model_against_itself_and_a_changed_verdict() -> None:
    a = load_results(ANALYSIS, EXPERIMENT)
    rows = {r["finding"]: r for r in findings(a, a)}
    assert {r["status"] for r in rows.values()} <= {"transfers", "same best mean, not separated"}
    assert rows["test 3 functional subspaces, q"]["a"] == "fails"
    assert rows["role signature attention → MLP"]["a"] == "transfers"
    assert rows["−20%, in-domain: after fine-tuning"]["a"] == "basis-sharing"  # a winner
    assert rows["−40%, in-domain: after fine-tuning"]["status"] == "same best mean, not separated"
    b = copy.deepcopy(a)
    b.analysis["tests"]["q"]["functional_subspaces"]["verdict"] = "lives"
    b.analysis["roles"]["attention_to_mlp"]["transfers"] = False
    for e in b.experiment["whole_model"]:  # another method best before fine-tuning
        if e["reduction"] == 0.2 and e["method"] == "hybrid":
            e["analytic"] = {t: 1.0 for t in e["analytic"]}
    rows = {r["finding"]: r for r in findings(a, b)}
    for key in ("test 3 functional subspaces, q", "role signature attention → MLP",
                "−20%, in-domain: best before fine-tuning"):
        assert rows[key]["status"] == "does not transfer", key
    assert rows["−20%, in-domain: best before fine-tuning"]["b"] == "hybrid"


def test_a_finding_one_model_lacks(tmp_path) -> None:
    """A budget only one model ran is "not measured on both", its empty cell a bare dash."""
    from structlm.experiments.share.transfer import write_transfer_report

    a = load_results(ANALYSIS, EXPERIMENT)
    b = copy.deepcopy(a)
    b.label = "fewer budgets"
    b.experiment["whole_model"] = [e for e in b.experiment["whole_model"]
                                   if e["reduction"] != 0.3]
    rows = {r["finding"]: r for r in findings(a, b)}
    lacking = rows["−30%, in-domain: best before fine-tuning"]
    assert lacking["status"] == "not measured on both" and lacking["b"] == "—"
    text = write_transfer_report(a, b, tmp_path).read_text()
    line = next(ln for ln in text.splitlines()
                if ln.startswith("| −30%, in-domain: best before fine-tuning"))
    assert line.endswith("| — | not measured on both |") and "— ()" not in text


def test_the_command_writes_the_report(tmp_path) -> None:
    out = tmp_path / "t8"
    run = subprocess.run([sys.executable, "-m", "structlm.cli", "experiment", "transfer",
                          "--analysis", str(ANALYSIS), str(ANALYSIS), "--experiment",
                          str(EXPERIMENT), str(EXPERIMENT), "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    text = (out / "report.md").read_text()
    assert "| finding | SmolLM2-135M-Instruct | SmolLM2-135M-Instruct | transfers? |" in text
    assert len(json.loads((out / "findings.json").read_text())) >= 30
    bad = subprocess.run([sys.executable, "-m", "structlm.cli", "experiment", "transfer",
                          "--analysis", str(tmp_path), str(ANALYSIS), "--experiment",
                          str(EXPERIMENT), str(EXPERIMENT), "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert f"{tmp_path}/results.json does not exist" in bad.stderr
    with pytest.raises(ValueError, match="structlm experiment share"):
        load_results(ANALYSIS, tmp_path)


def test_after_fine_tuning_compares_the_methods_both_models_tuned() -> None:
    """Each race (budget, text role) runs over the methods both models fine-tuned there: a
    winner absent from one model's race cannot decide it, and fewer than two common
    methods is no race."""
    a = load_results(ANALYSIS, EXPERIMENT)
    b = copy.deepcopy(a)
    b.label = "fewer tuned"
    for e in b.experiment["whole_model"]:
        if e["method"] not in ("svd", "shared"):
            e["finetuned"] = {}
        elif e["method"] == "shared" and e["reduction"] == 0.4:
            e["finetuned"] = {}  # -40%: only svd tuned on both
    rows = {r["finding"]: r for r in findings(a, b)}
    row = rows["−20%, in-domain: after fine-tuning"]
    # basis-sharing wins a's full race at -20%; over {shared, svd} both name one best
    assert row["a"].removesuffix(" *") == row["b"].removesuffix(" *")
    assert row["a"].removesuffix(" *") in ("svd", "shared")
    assert row["a_numbers"].startswith("among shared, svd: ")
    assert "basis-sharing" not in row["a_numbers"]
    lone = rows["−40%, in-domain: after fine-tuning"]
    assert lone["status"] == "not measured on both" and lone["a"] == lone["b"] == "—"
    for e in b.experiment["whole_model"]:
        e["finetuned"] = {}  # nothing tuned on b: every such row still listed
    rows = {r["finding"]: r for r in findings(a, b)}
    after = [k for k in rows if k.endswith("after fine-tuning")]
    assert len(after) == 8 and all(rows[k]["status"] == "not measured on both" for k in after)
