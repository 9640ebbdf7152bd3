"""Test 8's side-by-side report on the committed SmolLM2 results: a model against itself
transfers every finding it separates; a changed verdict is called out; test 3 by the
interval rule over calibration draws (older one-draw results: undecided)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from structlm.experiments.share.transfer import findings, load_results
from structlm.share.analysis.analyze import (
    FUNCTIONAL_VARIANTS,
    Thresholds,
    functional_summary,
)

ROOT = Path(__file__).resolve().parents[3]
ANALYSIS = ROOT / "benchmarks" / "results" / "share_smollm2_analysis"
EXPERIMENT = ROOT / "benchmarks" / "results" / "share_smollm2_experiment"


def _over_draws(margins: list[float], null: float = 0.6) -> dict:
    """A type's test 3 over draws (as ``structlm share analyze`` writes it) whose
    primary variant has these per-draw margins."""
    def draw(m: float) -> dict:
        score = null + m * (1 - null)
        return {v: {"score": score, "null_score": null, "margin": m, "k_input": 4,
                    "k_output": 4} for v in FUNCTIONAL_VARIANTS}
    seeds = list(range(len(margins)))
    return functional_summary({str(s): draw(m) for s, m in zip(seeds, margins, strict=True)},
                              seeds, Thresholds())


LIVES, FAILS, UNDECIDED = [0.8, 0.82, 0.79], [0.1, 0.12, 0.09], [0.2, 0.8, 0.5]


def test_a_model_against_itself_and_a_changed_verdict() -> None:
    a = load_results(ANALYSIS, EXPERIMENT)
    rows = {r["finding"]: r for r in findings(a, a)}
    assert {r["status"] for r in rows.values()} <= {"transfers", "same best mean, not separated",
                                                    "undecided"}
    # the committed results predate test 3's draws: one draw, no interval, undecided
    q = rows["test 3 functional subspaces, q"]
    assert q["a"] == "one draw: no interval" and q["status"] == "undecided"
    assert q["a_numbers"].startswith("m = 0.093, centred, older results (one draw)")
    assert rows["test 1 alignment, q"]["status"] == "transfers"
    assert rows["test 1 alignment, q"]["a_numbers"].endswith("one null draw")
    assert rows["role signature attention → MLP"]["a"] == "transfers"
    # the committed runs kept no per-window scores: the best mean, no winner claimed
    after = rows["−20%, in-domain: after fine-tuning"]
    assert after["a"] == "basis-sharing *" and "without per-window scores" in after["a_numbers"]
    assert rows["−40%, in-domain: after fine-tuning"]["status"] == "same best mean, not separated"
    b = copy.deepcopy(a)
    b.analysis["tests"]["q"]["weight_subspaces"]["verdict"] = "lives"
    b.analysis["roles"]["attention_to_mlp"]["transfers"] = False
    for e in b.experiment["whole_model"]:  # another method best before fine-tuning
        if e["reduction"] == 0.2 and e["method"] == "hybrid":
            e["analytic"] = {t: 1.0 for t in e["analytic"]}
    rows = {r["finding"]: r for r in findings(a, b)}
    for key in ("test 2 weight subspaces, q", "role signature attention → MLP",
                "−20%, in-domain: best before fine-tuning"):
        assert rows[key]["status"] == "does not transfer", key
    assert rows["−20%, in-domain: best before fine-tuning"]["b"] == "hybrid"


@pytest.mark.parametrize(("ma", "mb", "status"), [
    (LIVES, LIVES, "transfers"), (FAILS, FAILS, "transfers"),
    (LIVES, FAILS, "does not transfer"), (FAILS, LIVES, "does not transfer"),
    (LIVES, UNDECIDED, "undecided"), (UNDECIDED, UNDECIDED, "undecided"),
    (LIVES, [0.8], "undecided"), (LIVES, None, "undecided")])
def test_test_3_transfers_only_between_decided_equal_verdicts(ma, mb, status) -> None:
    """Test 3 by the interval rule over draws: transfers when both verdicts are decided
    and equal, does not when decided and different, undecided otherwise — also against
    one draw, or against an older results file (``None``: the committed one)."""
    a = load_results(ANALYSIS, EXPERIMENT)
    b = copy.deepcopy(a)
    a.analysis["tests"]["k"]["functional"] = _over_draws(ma)
    if mb is not None:
        b.analysis["tests"]["k"]["functional"] = _over_draws(mb)
    row = {r["finding"]: r for r in findings(a, b)}["test 3 functional subspaces, k"]
    assert row["status"] == status
    verdicts = {id(LIVES): "lives", id(FAILS): "fails", id(UNDECIDED): "undecided"}
    assert row["a"] == verdicts[id(ma)]
    assert row["a_numbers"].startswith(f"m = {sum(ma) / 3:.3f} [")
    assert "(n=3), centred; score " in row["a_numbers"]
    if mb is None or len(mb) == 1:
        assert row["b"] == "one draw: no interval"
    else:
        assert row["b"] == verdicts[id(mb)]


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
